"""`orbitflow serve` start-up: a port it cannot listen on is an error naming the flag, before the model loads; the
server solves ahead in a planner process unless told otherwise."""

import socket

import pytest

from orbitflow.cli import build_parser, main
from orbitflow.config import ConfigError, engine_config
from orbitflow.serve import server


def test_a_port_in_use_is_named_before_anything_loads(monkeypatch, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"--port {port}"):
            server._check_port_free("127.0.0.1", port)

        def no_loading(*args, **kwargs):
            raise AssertionError("the model was loaded before the port was checked")

        monkeypatch.setattr("orbitflow.llm.LLM", no_loading)
        assert main(["serve", "--port", str(port)]) == 2
        assert f"--port {port}" in capsys.readouterr().err
        if _has_ray():  # --replicas too, before Ray starts (it was a Ray traceback after 12 s)
            monkeypatch.setattr("orbitflow.serve.cluster.run_cluster", no_loading)
            assert main(["serve", "--replicas", "2", "--port", str(port)]) == 2
            assert f"--port {port}" in capsys.readouterr().err
    server._check_port_free("127.0.0.1", port)  # free again


def test_an_unknown_host_is_named():
    with pytest.raises(ConfigError, match="--host"):
        server._check_port_free("no-such-host.invalid", 8000)


def _has_ray() -> bool:
    try:
        import orbitflow.serve.cluster  # noqa: F401
    except ImportError:
        return False
    return True


def test_serve_solves_ahead_in_a_planner_process_by_default_and_a_flag_still_wins():
    """A server runs long: its planner is the process whatever the core count (generate keeps auto); the flag
    overrides it."""
    parse = build_parser().parse_args
    assert engine_config(parse(["serve"])).planner.background_planner == "process"
    for mode in ("auto", "thread", "off"):
        assert engine_config(parse(["serve", "--background-planner", mode])).planner.background_planner == mode
    assert parse(["generate", "--prompt", "x"]).background_planner == "auto"
