"""ParallelConfig and its flags: bad values name the flag; a size that does not divide the model is a usage error."""

import pytest

from orbitflow.cli import build_parser, main
from orbitflow.config import ConfigError, ParallelConfig, config_from_args


@pytest.mark.parametrize("kwargs, flag", [({"tensor_parallel_size": 0}, "--tensor-parallel-size"),
                                          ({"tp_link": "pcie"}, "--tp-link"),
                                          ({"collective_timeout_s": 0}, "--collective-timeout")])
def test_bad_values_name_the_flag(kwargs, flag):
    with pytest.raises(ConfigError, match=flag):
        ParallelConfig(**kwargs)


@pytest.mark.parametrize("kwargs, flag", [({"tp_link": "shared"}, "--tp-link"),
                                          ({"collective_timeout_s": 5.0}, "--collective-timeout")])
def test_a_rank_flag_without_ranks_is_an_error_not_ignored(kwargs, flag):
    with pytest.raises(ConfigError, match=f"{flag} needs --tensor-parallel-size"):
        ParallelConfig(1, **kwargs)
    assert ParallelConfig(2, **kwargs).tensor_parallel_size == 2


def test_shared_link_splits_the_rate_per_rank():
    assert ParallelConfig(3, tp_link="shared").rank_link_bytes_per_s(3e9) == pytest.approx(1e9)
    assert ParallelConfig(3, tp_link="per-rank").rank_link_bytes_per_s(3e9) == 3e9
    assert ParallelConfig(3, tp_link="shared").rank_link_bytes_per_s(None) is None


@pytest.mark.parametrize("command", ["serve", "generate", "profile"])
def test_flags_on_serve_generate_profile(command):
    extra = ["--prompt", "x"] if command == "generate" else []
    args = build_parser().parse_args([command, "--tensor-parallel-size", "3", "--tp-link", "shared",
                                      "--collective-timeout", "5", *extra])
    assert config_from_args(ParallelConfig, args) == ParallelConfig(3, "shared", 5.0)


def test_size_that_does_not_divide_the_kv_heads_is_a_clean_error(capsys):
    assert main(["generate", "--tensor-parallel-size", "2", "--prompt", "hi", "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert "--tensor-parallel-size 2 does not divide the model's KV heads (3); valid sizes for this model: 1, 3" in err
