"""config.py: one dataclass per concern, flat build/replace, errors naming the flag, flags from the fields."""

import argparse
import math
from dataclasses import fields

import pytest

from orbitflow.config import (
    ENGINE_CONCERNS,
    CacheConfig,
    ConfigError,
    EngineConfig,
    PlannerConfig,
    SchedulerConfig,
    ServerConfig,
    add_config_args,
    add_engine_args,
    config_from_args,
    dest_of,
    engine_config,
)


def test_build_routes_flat_names_to_their_concern():
    c = EngineConfig.build(model="tiny", device_kv_blocks=512, max_num_seqs=2, alpha=1.0, seed=7)
    assert (c.model.name, c.model.seed) == ("tiny", 7)
    assert c.cache.device_kv_blocks == 512 and c.cache.host_kv_blocks == CacheConfig().host_kv_blocks
    assert c.scheduler.max_num_seqs == 2 and c.planner.alpha == 1.0
    d = c.replace(policy="deepspeed")
    assert d.planner.policy == "deepspeed" and d.planner.alpha == 1.0 and d.cache == c.cache
    assert c.planner.policy == "orbitflow"  # replace returns a copy
    with pytest.raises(ConfigError, match="unknown config field"):
        EngineConfig.build(extra={})


@pytest.mark.parametrize("flat, flag", [
    ({"device_kv_blocks": 0}, "--device-kv-blocks"), ({"link_gbps": -1.0}, "--link-gbps"),
    ({"prefetch_slots": 0}, "--prefetch-slots"), ({"max_num_seqs": 0}, "--max-num-seqs"),
    ({"scheduling": "lifo"}, "--scheduling"), ({"alpha": -0.1}, "--alpha"), ({"ewma": 1.5}, "--ewma"),
    ({"victim": "oldest"}, "--victim"), ({"window_min": 9, "window_max": 8}, "--window-min"),
    ({"plan_time_limit_ms": -1.0}, "--plan-time-limit-ms"), ({"compute_threads": 0}, "--compute-threads"),
    ({"seed": -1}, "--seed"),  # the random victim rule seeds numpy with it (it raised inside every overloaded step)
    ({"deposit_guard_ms": -1.0}, "--deposit-guard-ms"), ({"slo_ms": 10.0, "deposit_guard_ms": 10.0}, "--deposit-guard"),
    ({"window_max": 100_000}, "--window-max"),  # a one-request plan ran for minutes
    ({"plan_gap": -1e-4}, "--plan-gap must be >= 0"), ({"plan_gap": 1.0}, "--plan-gap must be under 1"),
    ({"slo_ms": 50.0, "slo_scale": 2.0}, "--slo-ms and --slo-scale are exclusive"),  # slo_scale was dropped unsaid
])
def test_a_bad_value_names_its_flag(flat, flag):
    with pytest.raises(ConfigError, match=flag):
        EngineConfig.build(**flat)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("flat, flag", [
    ("link_gbps", "--link-gbps"), ("alpha", "--alpha"), ("slo_ms", "--slo-ms"), ("slo_scale", "--slo-scale"),
    ("plan_time_limit_ms", "--plan-time-limit-ms"), ("ewma", "--ewma"), ("plan_gap", "--plan-gap"),
])
def test_a_value_that_is_not_finite_names_its_flag(flat, flag, bad):
    """NaN passes every `<= 0` check (it compares False), so it got through and failed deep inside the run."""
    with pytest.raises(ConfigError, match=f"{flag} must be a finite number"):
        EngineConfig.build(**{flat: bad})


def test_server_config_checks():
    with pytest.raises(ConfigError, match="--port"):
        ServerConfig(port=70000)
    with pytest.raises(ConfigError, match="--watchdog-s"):
        ServerConfig(watchdog_s=0)
    for flag, name in (("--watchdog-s", "watchdog_s"), ("--shutdown-timeout", "shutdown_timeout")):
        with pytest.raises(ConfigError, match=f"{flag} must be a finite number"):
            ServerConfig(**{name: math.nan})
    assert ServerConfig(watchdog_s=math.inf).watchdog_s == math.inf  # the watchdog off, as before
    with pytest.raises(ConfigError, match="--shutdown-timeout must be a finite number"):
        ServerConfig(shutdown_timeout=math.inf)  # threading.Timer cannot wait that long
    for empty in ("", "  "):  # what --api-key "$UNSET" gives: it turned authentication off without a word
        with pytest.raises(ConfigError, match="--api-key is empty"):
            ServerConfig(api_key=empty)
    assert ServerConfig(api_key="k").api_key == "k" and ServerConfig().api_key is None


@pytest.mark.parametrize("value", ["abc", "0", "-2", "1.5"])
def test_a_bad_orbitflow_num_threads_is_an_error_naming_it(monkeypatch, value):
    """It raised a bare ValueError or RuntimeError from torch, a traceback instead of a message."""
    from orbitflow.model.errors import ModelLoadError
    from orbitflow.model.loader import configure_cpu_threads

    monkeypatch.setenv("ORBITFLOW_NUM_THREADS", value)
    with pytest.raises(ModelLoadError, match=f"ORBITFLOW_NUM_THREADS must be an integer >= 1.*got '{value}'"):
        configure_cpu_threads()


def test_flags_come_from_the_fields_once_with_their_defaults():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args([])
    assert engine_config(args) == EngineConfig()  # every default of the parser is the dataclass's
    dests = [dest_of(f) for _, cls, _ in ENGINE_CONCERNS for f in fields(cls)]
    assert len(dests) == len(set(dests))  # a flat name belongs to one concern
    args = parser.parse_args(["--no-token-deposit", "--plan-node-limit", "none", "--slo-ms", "80"])
    c = engine_config(args)
    assert not c.planner.token_deposit and c.planner.plan_node_limit is None and c.planner.slo_ms == 80.0
    with pytest.raises(SystemExit):  # --slo-ms and --slo-scale exclude each other
        parser.parse_args(["--slo-ms", "80", "--slo-scale", "2"])


def test_a_subcommand_picks_fields_and_overrides_defaults():
    parser = argparse.ArgumentParser()
    add_config_args(parser, SchedulerConfig, "scheduling", only=("max_queue_len",), defaults={"max_queue_len": 256})
    add_config_args(parser, PlannerConfig, only=("alpha",))
    add_config_args(parser, ServerConfig, "server")
    args = parser.parse_args(["--port", "9000"])
    assert args.max_queue_len == 256 and args.alpha == PlannerConfig().alpha and not hasattr(args, "policy")
    assert config_from_args(ServerConfig, args) == ServerConfig(port=9000)
    assert engine_config(args).scheduler.max_queue_len == 256
    assert engine_config(parser.parse_args(["--max-queue-len", "none"])).scheduler.max_queue_len is None
    with pytest.raises(ConfigError, match="--max-queue-len"):  # 0 is not 'unbounded' here: it is refused
        engine_config(parser.parse_args(["--max-queue-len", "0"]))


def test_replica_flags_without_replicas_are_errors():
    """--router and --replica-cpus without --replicas were ignored without a word (one engine ran); only
    --ray-address was checked."""
    from orbitflow.config import ClusterConfig

    for kwargs, flag in (({"ray_address": "auto"}, "--ray-address"), ({"router": "round-robin"}, "--router"),
                         ({"replica_cpus": 8.0}, "--replica-cpus")):
        with pytest.raises(ConfigError, match=f"{flag} needs --replicas N"):
            ClusterConfig(**kwargs)
        assert ClusterConfig(replicas=2, **kwargs).replicas == 2
    assert ClusterConfig().replicas is None



def test_fields_built_from_python_have_their_flags_types():
    """port='8000' failed a comparison with a TypeError, and block_size=16.5 or token_deposit='no' passed."""
    from orbitflow.config import PlannerConfig

    for make, flag in ((lambda: ServerConfig(port="8000"), "--port must be an integer"),
                       (lambda: CacheConfig(block_size=16.5), "--block-size must be an integer"),
                       (lambda: PlannerConfig(alpha="0.5"), "--alpha must be a number"),
                       (lambda: PlannerConfig(token_deposit="no"), "--token-deposit must be true or false")):
        with pytest.raises(ConfigError, match=flag):
            make()
    assert ServerConfig(shutdown_timeout=5).shutdown_timeout == 5  # an int is a number
    assert PlannerConfig(token_deposit=False).token_deposit is False
