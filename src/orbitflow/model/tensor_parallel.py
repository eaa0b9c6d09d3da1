"""Megatron-style tensor parallelism of a Llama-family model: one rank's shard, built from the same model code.

Rank r of N holds
- attention: query heads r*Hq/N .. (r+1)*Hq/N and KV heads r*Hkv/N .. (r+1)*Hkv/N of the fused q/k/v
  projection (column split, so each rank's heads are whole and GQA groups stay on one rank), and the
  matching input columns of o_proj (row split);
- MLP: rows r*I/N .. (r+1)*I/N of gate and up (column split) and those columns of down_proj (row split);
- embeddings, norms and the LM head whole (replicated).

Each row-split projection yields a partial sum of the hidden state: `RowParallelLinear` all-reduces it over
the group (one all-reduce after attention, one after the MLP) and adds the bias once, after the sum. The
shard is an ordinary `LlamaModel` over a `ModelConfig` with N times fewer heads and intermediate units, so
the executor, the KV pools (which hold Hkv/N heads per rank) and the attention code run unchanged.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from orbitflow.model.config import ModelConfig
from orbitflow.model.errors import ModelLoadError
from orbitflow.model.llama import LlamaModel


class TensorParallelError(ModelLoadError, ValueError):
    """The model cannot be split over the requested number of ranks; the message names the flag."""


def check_tp_size(config: ModelConfig, size: int) -> None:
    """Raise TensorParallelError unless `size` divides the query heads, the KV heads and the intermediate size."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise TensorParallelError(f"--tensor-parallel-size must be an integer >= 1, got {size!r}")
    parts = (("KV heads", config.num_kv_heads), ("attention heads", config.num_heads),
             ("intermediate size", config.intermediate_size))
    for what, count in parts:
        if count % size:
            valid = [n for n in range(1, config.num_kv_heads + 1)
                     if all(c % n == 0 for _, c in parts)]
            raise TensorParallelError(
                f"--tensor-parallel-size {size} does not divide the model's {what} ({count}); "
                f"valid sizes for this model: {', '.join(map(str, valid))}"
            )


def shard_config(config: ModelConfig, size: int) -> ModelConfig:
    """The architecture one rank of `size` runs: N times fewer heads and intermediate units, same hidden size."""
    check_tp_size(config, size)
    return replace(config, num_heads=config.num_heads // size, num_kv_heads=config.num_kv_heads // size,
                   intermediate_size=config.intermediate_size // size)


def shard_state(tensors: dict[str, Tensor], config: ModelConfig, rank: int, size: int) -> dict[str, Tensor]:
    """Rank `rank`'s slice of HF-named weights (see the module docstring); replicated tensors pass through."""
    d = config.head_dim
    q_rows = config.num_heads // size * d
    kv_rows = config.num_kv_heads // size * d
    inter = config.intermediate_size // size
    out: dict[str, Tensor] = {}
    for name, t in tensors.items():
        if name.endswith("self_attn.q_proj.weight") or name.endswith("self_attn.q_proj.bias"):
            t = t[rank * q_rows:(rank + 1) * q_rows]
        elif any(name.endswith(f"self_attn.{p}_proj.{w}") for p in "kv" for w in ("weight", "bias")):
            t = t[rank * kv_rows:(rank + 1) * kv_rows]
        elif name.endswith("self_attn.o_proj.weight"):
            t = t[:, rank * q_rows:(rank + 1) * q_rows]
        elif name.endswith("mlp.gate_proj.weight") or name.endswith("mlp.up_proj.weight"):
            t = t[rank * inter:(rank + 1) * inter]
        elif name.endswith("mlp.down_proj.weight"):
            t = t[:, rank * inter:(rank + 1) * inter]
        out[name] = t.contiguous()
    return out


class RowParallelLinear(nn.Module):
    """A row-split linear layer: the local partial product, summed over the group, plus the bias once."""

    def __init__(self, linear: nn.Linear, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.group = group

    def forward(self, x: Tensor) -> Tensor:
        out = F.linear(x, self.weight)
        dist.all_reduce(out, group=self.group)
        return out if self.bias is None else out + self.bias


def build_shard(model_dir: str | Path, rank: int, size: int, group: dist.ProcessGroup | None = None,
                dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> LlamaModel:
    """Rank `rank`'s shard of the model in an HF directory, with its row-split layers all-reducing over `group`
    (the default group when None). torch.distributed must be initialised."""
    from safetensors.torch import load_file

    from orbitflow.model.loader import read_model_config, safetensors_files

    config = read_model_config(Path(model_dir))
    local = shard_config(config, size)
    tensors: dict[str, Tensor] = {}
    for file in safetensors_files(Path(model_dir)):
        tensors.update(shard_state(load_file(file), config, rank, size))
    model = LlamaModel(local, dtype=dtype)
    model.load_state(tensors)
    del tensors
    for layer in model.layers:
        layer.self_attn.o_proj = RowParallelLinear(layer.self_attn.o_proj, group)
        layer.mlp.down_proj = RowParallelLinear(layer.mlp.down_proj, group)
    return model.to(device).eval().requires_grad_(False)
