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


def test_serve_takes_a_saved_profile_to_each_engine_and_names_a_bad_one_before_loading(monkeypatch, capsys, tmp_path):
    """--profile FILE (from `orbitflow profile --out FILE`): the server's engine, or each replica's, plans with it
    instead of a minute of measuring; a file that is missing or not a profile is named before the model loads."""
    from orbitflow.plan.hardware import HardwareProfile

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before --profile was read")

    monkeypatch.setattr("orbitflow.llm.LLM", no_loading)
    assert main(["serve", "--profile", str(tmp_path / "missing.json")]) == 2
    assert f"--profile {tmp_path / 'missing.json'}: No such file or directory" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{}")
    assert main(["serve", "--profile", str(tmp_path / "bad.json")]) == 2
    assert "missing required field" in capsys.readouterr().err
    saved = HardwareProfile(name="saved", num_layers=30, kv_bytes_per_token_per_layer=1536, decode_a=1e-7,
                            decode_b=0.03, link_bytes_per_s=1e10, device_kv_blocks=4096, host_kv_blocks=4096)
    (tmp_path / "saved.json").write_text(saved.to_json())
    given = []
    monkeypatch.setattr(server, "run_server", lambda config, srv, profile: given.append(profile))
    monkeypatch.setattr(server, "_run_replicas", lambda config, srv, cluster, profile: given.append(profile) or 0)
    assert main(["serve", "--profile", str(tmp_path / "saved.json")]) == 0
    assert main(["serve", "--replicas", "2", "--profile", str(tmp_path / "saved.json")]) == 0
    assert given == [saved, saved]
    assert main(["serve", "--replicas", "2"]) == 0
    assert given[-1] == "measure"
