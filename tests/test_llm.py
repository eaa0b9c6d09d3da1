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


def test_max_model_len_past_the_models_context_names_the_flag(tiny_llama):  # noqa: F811
    """As vLLM: positions past the model's own context were never trained (before, the flag was taken as given)."""
    limit = tiny_llama.config.max_position_embeddings
    with pytest.raises(ConfigError, match=f"--max-model-len {limit + 1} exceeds tiny's context of {limit}"):
        make_llm(tiny_llama, max_model_len=limit + 1)
    llm = make_llm(tiny_llama, max_model_len=limit)
    llm.close()
