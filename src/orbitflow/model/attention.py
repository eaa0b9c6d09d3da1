"""The attention contract between the model and the KV cache, plus a dense reference backend.

The model owns no KV cache: each decoder layer hands its RoPE'd q/k/v for the packed batch to an
`AttentionBackend`, which stores k/v wherever it likes and returns the attention output.
"""

from collections.abc import Hashable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor


class AttentionBackend(Protocol):
    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] for the T tokens of the packed batch
        (RoPE already applied). Returns [T, num_heads * head_dim]."""
        ...


def causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """Attention of the last n positions of one sequence over its full keys/values.

    q: [n, Hq, D]; k, v: [C, Hkv, D] with C >= n. Query i sits at absolute position C - n + i and sees keys
    0..C-n+i. Returns [n, Hq * D].
    """
    n, num_heads, head_dim = q.shape
    context = k.shape[0]
    gqa = num_heads != k.shape[1]
    # SDPA layout [batch=1, heads, tokens, head_dim], as transformers calls it.
    q4 = q.transpose(0, 1).unsqueeze(0)
    k4 = k.transpose(0, 1).unsqueeze(0)
    v4 = v.transpose(0, 1).unsqueeze(0)
    if n == 1:
        out = F.scaled_dot_product_attention(q4, k4, v4, scale=scale, enable_gqa=gqa)
    elif n == context:
        out = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        query_positions = torch.arange(context - n, context, device=q.device)
        key_positions = torch.arange(context, device=q.device)
        mask = key_positions[None, :] <= query_positions[:, None]
        out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2).reshape(n, num_heads * head_dim)


def decode_attention(q: Tensor, kv: list[tuple[Tensor, Tensor]], scale: float) -> Tensor:
    """Attention of one new token per sequence over its whole KV (a decode step), one SDPA call per sequence.

    q: [B, Hq, D]; kv[b]: K, V of sequence b as [1, Hkv, C_b, D] (any strides, e.g. views of a paged pool;
    lengths may differ). Returns [B, Hq * D], equal to `causal_attention` row by row. Separate calls over the
    views beat one call over a padded copy on the CPU: at 2048 tokens x 4 rows (SmolLM2-135M's heads), 0.9 ms
    vs 2.8 ms a layer (one-layer microbenchmark, 2 threads), the copy costing more than the batching saves.
    """
    batch, num_heads, head_dim = q.shape
    gqa = num_heads != kv[0][0].shape[1]
    q4 = q.unsqueeze(2)  # [B, Hq, 1, D]
    outputs = [F.scaled_dot_product_attention(q4[b:b + 1], k, v, scale=scale, enable_gqa=gqa)
               for b, (k, v) in enumerate(kv)]
    out = torch.cat(outputs) if batch > 1 else outputs[0]
    return out.view(batch, num_heads * head_dim)


class _GrowingKV:
    """Contiguous k/v of one sequence at one layer, with amortised O(1) appends."""

    def __init__(self, k: Tensor, v: Tensor) -> None:
        capacity = max(16, 2 * k.shape[0])
        self.k = k.new_empty((capacity, *k.shape[1:]))
        self.v = v.new_empty((capacity, *v.shape[1:]))
        self.length = 0

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        end = self.length + k.shape[0]
        if end > self.k.shape[0]:
            capacity = 2 * end
            self.k = torch.cat((self.k[: self.length], k.new_empty((capacity - self.length, *k.shape[1:]))))
            self.v = torch.cat((self.v[: self.length], v.new_empty((capacity - self.length, *v.shape[1:]))))
        self.k[self.length : end] = k
        self.v[self.length : end] = v
        self.length = end
        return self.k[:end], self.v[:end]


class DenseKVAttention:
    """Reference backend: one contiguous KV cache per sequence and layer, attention via `causal_attention`.

    Call `set_batch` before each forward with the sequences of the packed batch, in order.
    """

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self._caches: dict[Hashable, list[_GrowingKV | None]] = {}
        self._segments: list[tuple[Hashable, int]] = []

    def set_batch(self, seq_ids: list, num_new_tokens: list[int]) -> None:
        if len(seq_ids) != len(num_new_tokens):
            raise ValueError("seq_ids and num_new_tokens must have the same length")
        self._segments = list(zip(seq_ids, num_new_tokens))
        for seq_id in seq_ids:
            self._caches.setdefault(seq_id, [None] * self.num_layers)

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        scale = q.shape[-1] ** -0.5
        outputs = []
        start = 0
        for seq_id, count in self._segments:
            end = start + count
            layer_caches = self._caches[seq_id]
            if layer_caches[layer] is None:
                layer_caches[layer] = _GrowingKV(k[start:end], v[start:end])
            all_k, all_v = layer_caches[layer].append(k[start:end], v[start:end])
            outputs.append(causal_attention(q[start:end], all_k, all_v, scale))
            start = end
        if start != q.shape[0]:
            raise ValueError(f"batch segments cover {start} tokens but the forward has {q.shape[0]}")
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def seq_len(self, seq_id: Hashable) -> int:
        caches = self._caches.get(seq_id)
        return 0 if not caches or caches[0] is None else caches[0].length

    def free(self, seq_id: Hashable) -> None:
        self._caches.pop(seq_id, None)
