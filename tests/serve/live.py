"""Live-server helpers for the API tests: an LLM on the tiny chat model, uvicorn in a thread."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import uvicorn

MODEL_NAME = "tiny-chat"


def make_server_llm(model_dir, **config):
    from orbitflow.config import EngineConfig
    from orbitflow.llm import LLM
    from orbitflow.model.loader import load_model

    config.setdefault("device_kv_blocks", 512)
    config.setdefault("host_kv_blocks", 2048)
    return LLM(EngineConfig.build(model=MODEL_NAME, **config), profile="rough",
               loaded=load_model(str(model_dir)))


@dataclass
class LiveServer:
    url: str  # http://127.0.0.1:PORT
    llm: object

    def metric(self, client, name: str) -> float:
        for line in client.get(f"{self.url}/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)


@contextmanager
def live_server(llm, api_key: str | None = None, **app_options) -> Iterator[LiveServer]:
    """Uvicorn on a pre-bound loopback socket (no port race), in a background thread."""
    from orbitflow.serve.api import build_app

    app = build_app(llm, MODEL_NAME, api_key=api_key, **app_options)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield LiveServer(f"http://127.0.0.1:{port}", llm)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
        llm.close()


def kv_empty(llm) -> bool:
    return llm.engine.kv.usage() == (0, 0)


def wait_until_idle(llm, timeout_s: float = 60.0) -> None:
    engine = llm.engine
    deadline = time.monotonic() + timeout_s
    while engine.has_work() or engine.running or engine.waiting or engine.paused:
        if time.monotonic() > deadline:
            raise TimeoutError("engine did not go idle")
        time.sleep(0.05)
