"""Sharding a Llama-family model: the slices of every rank put back together are the whole model."""

import pytest
import torch
from tiny_models import _tiny

from orbitflow.model.tensor_parallel import TensorParallelError, check_tp_size, shard_config, shard_state


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return _tiny("llama", tmp_path_factory)


def test_shards_reassemble_the_weights(tiny_llama):
    config = tiny_llama.config
    full = {k: v for k, v in tiny_llama.hf.state_dict().items()}
    shards = [shard_state(full, config, rank, 2) for rank in range(2)]
    local = shard_config(config, 2)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (2, 1, 64)
    for name, tensor in full.items():
        parts = [s[name] for s in shards]
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight")):
            assert torch.equal(torch.cat(parts, 0), tensor), name
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            assert torch.equal(torch.cat(parts, 1), tensor), name
        else:  # embeddings, norms, LM head: replicated
            assert all(torch.equal(p, tensor) for p in parts), name
    q = shards[1]["model.layers.0.self_attn.q_proj.weight"]
    assert q.shape == (local.num_heads * config.head_dim, config.hidden_size)


def test_size_must_divide_heads_and_intermediate(tiny_llama):
    check_tp_size(tiny_llama.config, 1)
    check_tp_size(tiny_llama.config, 2)
    with pytest.raises(TensorParallelError, match="KV heads"):
        check_tp_size(tiny_llama.config, 4)
    with pytest.raises(TensorParallelError, match="must be an integer >= 1"):
        check_tp_size(tiny_llama.config, 0)
