"""Rotary position embeddings with transformers' exact float32 formulas (incl. llama3 scaling)."""

import math

import torch
from torch import nn


def rope_inverse_frequencies(
    head_dim: int, rope_theta: float, rope_scaling: dict | None, max_position_embeddings: int
) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim
    inv_freq = 1.0 / (rope_theta**exponents)
    if rope_scaling is None:
        return inv_freq
    if rope_scaling["rope_type"] != "llama3":
        raise ValueError(f"unsupported rope_type {rope_scaling['rope_type']!r}")
    return _llama3_scaled(inv_freq, rope_scaling, max_position_embeddings)


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict, max_position_embeddings: int) -> torch.Tensor:
    """Llama 3.1 frequency scaling: keep high frequencies, divide low ones by `factor`, blend in between."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling.get("original_max_position_embeddings") or max_position_embeddings

    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth_factor) * scaled / factor + smooth_factor * scaled
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(
        self, head_dim: int, rope_theta: float, rope_scaling: dict | None, max_position_embeddings: int
    ) -> None:
        super().__init__()
        inv_freq = rope_inverse_frequencies(head_dim, rope_theta, rope_scaling, max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, head_dim] for the given absolute positions [T]."""
        # Computed per forward (not from a table) so every value is bit-identical to transformers.
        freqs = positions[:, None].float() * self.inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos, sin: [T, 1, head_dim] (`cos_sin` unsqueezed once, shared by every layer)."""
    return (x * cos) + (rotate_half(x) * sin)
