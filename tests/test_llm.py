"""--device: where the engine runs, and errors that name the flag."""

import pytest
import torch
from tiny_models import make_llm, tiny_llama  # noqa: F401  (session fixture)

from orbitflow.config import ConfigError, EngineConfig
from orbitflow.llm import resolve_device


def test_device_flag_is_checked():
    with pytest.raises(ConfigError, match="--device"):
        EngineConfig.build(device="gpu")
    assert EngineConfig.build(device="cpu").model.device == "cpu"


def test_auto_and_explicit_devices():
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == "cpu"
    if torch.cuda.is_available():
        assert resolve_device("cuda") == "cuda"
    else:
        with pytest.raises(ConfigError, match="--device cuda"):
            resolve_device("cuda")


def test_cpu_runs_on_the_cpu_even_with_a_gpu(tiny_llama):  # noqa: F811
    llm = make_llm(tiny_llama, device="cpu")
    try:
        assert llm.kv.device_pool.storage.device.type == "cpu"
    finally:
        llm.close()
