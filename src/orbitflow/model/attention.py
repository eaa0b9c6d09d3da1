"""The attention contract between the model and the KV cache, plus a dense reference backend.

The model owns no KV cache: each decoder layer hands its RoPE'd q/k/v for the packed batch to an
`AttentionBackend`, which stores k/v wherever it likes and returns the attention output.
"""

import math
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


def causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, split_k: bool = True) -> Tensor:
    """Attention of the last n positions of one sequence over its full keys/values.

    q: [n, Hq, D]; k, v: [C, Hkv, D] with C >= n. Query i sits at absolute position C - n + i and sees keys
    0..C-n+i. Returns [n, Hq * D]. `split_k`: as `decode_attention`'s, for n = 1.
    """
    n, num_heads, head_dim = q.shape
    context = k.shape[0]
    gqa = num_heads != k.shape[1]
    # SDPA layout [batch=1, heads, tokens, head_dim], as transformers calls it.
    k4 = k.transpose(0, 1).unsqueeze(0)
    v4 = v.transpose(0, 1).unsqueeze(0)
    if n == 1:  # one token: the decode kernel, so a chunk of one equals a decode step (same `split_k`) bit for bit
        threads = torch.get_num_threads() if split_k else 1
        return _grouped_decode(q, k4, v4, scale, decode_splits(k4.shape[1], context, threads))
    q4 = q.transpose(0, 1).unsqueeze(0)
    if n == context:
        out = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        query_positions = torch.arange(context - n, context, device=q.device)
        key_positions = torch.arange(context, device=q.device)
        mask = key_positions[None, :] <= query_positions[:, None]
        out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2).reshape(n, num_heads * head_dim)


# Split-K on the CPU: SDPA's CPU kernel shares a call's (batch x head) items among the intra-op threads, each item
# reading all of its keys, so a call over one row of SmolLM2's 3 KV heads on 2 threads leaves one thread idle a
# third of the time (transformers' one call over its static cache, 4 rows x 3 heads, does not). A long row is cut
# into `splits` equal stretches, one call over them as a batch (views, no copy), then merged by their logsumexp.
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
# Stretches of 1024 tokens gained (2048 x 4 rows: 1.08 vs 1.28 ms a layer), of 256 lost (512 x 4: 0.47 vs 0.35 ms), in
# a microbenchmark over 8 layers' KV (out of cache, as in a step), SmolLM2-135M's heads, 2 threads.
SPLIT_MIN_TOKENS = 1024


def _rounds(units: int, num_kv_heads: int, threads: int) -> float:
    """Rounds of (unit x KV head) items that `threads` threads take for one call over `units` stretches or rows,
    per unit: `ceil(units * heads / threads) / units` (each item one key stretch of one head)."""
    return math.ceil(units * num_kv_heads / max(threads, 1)) / units


def decode_splits(num_kv_heads: int, context: int, threads: int) -> int:
    """Stretches to cut one row's `context` keys into on the CPU: the count, of at most `threads` stretches of at
    least `SPLIT_MIN_TOKENS` keys, whose (stretch x KV head) items `threads` threads finish soonest (the least
    `_rounds` per stretch; the fewest stretches on a tie); 1 unless that beats the uncut row (one thread, heads
    that already divide evenly, or a row too short)."""
    best, best_rounds = 1, _rounds(1, num_kv_heads, threads)
    for splits in range(2, min(threads, context // SPLIT_MIN_TOKENS) + 1):
        rounds = _rounds(splits, num_kv_heads, threads)
        if rounds < best_rounds:
            best, best_rounds = splits, rounds
    return best


def _grouped_decode(q: Tensor, k: Tensor, v: Tensor, scale: float, splits: int = 1) -> Tensor:
    """One token's attention over one sequence's K, V [1, Hkv, C, D] (any strides): q [1, Hq, D] -> [1, Hq * D].

    Each KV head's group of query heads goes in as that many queries of it (q as [1, Hkv, Hq / Hkv, D]), as
    transformers does under a mask: SDPA then reads every K and V row once for the group instead of once per
    query head, with no mask (the token sees every key) and no copy (`enable_gqa` on the CPU costs about 1.8x
    as much at 8192 tokens, SmolLM2-135M's heads). With `splits` > 1 (CPU tensors only), split-K as above.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[1]
    grouped = q.reshape(1, num_kv_heads, num_heads // num_kv_heads, head_dim)
    if splits <= 1 or _CPU_FLASH is None or k.device.type != "cpu":
        out = F.scaled_dot_product_attention(grouped, k, v, scale=scale)
        return out.reshape(1, num_heads * head_dim)
    context = k.shape[2]
    splits = min(splits, context)  # no empty stretch
    stretch = context // splits
    parts = []
    for t in (k, v):
        size, stride = (splits, num_kv_heads, stretch, head_dim), t.stride()
        parts.append(t.as_strided(size, (stretch * stride[2], *stride[1:]), t.storage_offset()))
    out, lse = _CPU_FLASH(grouped.expand(splits, -1, -1, -1), parts[0], parts[1], scale=scale)
    if splits * stretch < context:  # the last (fewer than `splits`) keys
        tail, tail_lse = _CPU_FLASH(grouped, k[:, :, splits * stretch:], v[:, :, splits * stretch:], scale=scale)
        out, lse = torch.cat((out, tail)), torch.cat((lse, tail_lse))
    weights = torch.softmax(lse, dim=0).unsqueeze(-1)  # each stretch's share of the row's softmax mass (float32)
    return (out * weights).sum(0).to(q.dtype).reshape(1, num_heads * head_dim)


def decode_attention(q: Tensor, kv: list[tuple[Tensor, Tensor]], scale: float, split_k: bool = True) -> Tensor:
    """Attention of one new token per sequence over its whole KV (a decode step).

    q: [B, Hq, D]; kv[b]: K, V of sequence b as [1, Hkv, C_b, D] (any strides, e.g. views of a paged pool;
    lengths may differ). Returns [B, Hq * D], each row equal to `causal_attention` over its own KV.

    On the CPU, rows of one length whose K (and V) are views of one tensor at evenly spaced offsets (`row_groups`:
    any two such rows, more where the spacing repeats) go through one SDPA call, a batch of strided views, no
    copy; every other row gets a call of its own (`_grouped_decode`, cut into stretches where `decode_splits` says
    and `split_k` allows). A grouped row equals its own call bit for bit when that call is not cut. One call over a
    padded copy of every row costs more than it saves on the CPU: 1.2 vs 1.8 ms a layer at 2048 tokens x 4 rows,
    4.3 vs 8.9 ms at 8192 (SmolLM2-135M's heads, 2 threads, a microbenchmark over 8 layers' KV).
    """
    threads = torch.get_num_threads()
    groups = row_groups(kv, threads, split_k) if len(kv) > 1 and _CPU_FLASH is not None and q.device.type == "cpu" \
        else []
    order: list[int] = []
    outputs: list[Tensor] = []
    for rows in groups:
        outputs.append(_group_decode(q, kv, rows, scale))
        order.extend(rows)
    alone = sorted(set(range(len(kv))).difference(order))
    split_threads = threads if split_k else 1
    for b in alone:
        k, v = kv[b]
        outputs.append(_grouped_decode(q[b:b + 1], k, v, scale, decode_splits(k.shape[1], k.shape[2], split_threads)))
    out = torch.cat(outputs) if len(outputs) > 1 else outputs[0]
    order.extend(alone)
    if order != list(range(len(kv))):  # back to the batch's order
        out = out[torch.tensor(order).argsort()]
    return out


def row_groups(kv: list[tuple[Tensor, Tensor]], threads: int, split_k: bool = True) -> list[list[int]]:
    """Rows of a decode batch that one SDPA call can take together: K and V [1, Hkv, C, D] of the same length,
    views of one tensor with the same strides, whose K offsets step by a constant (a batch dimension of stride
    that step). Any two such rows qualify; a longer run only where the spacing repeats. Returns groups of 2 or more
    rows, each in offset order (the rest of the rows are left out).

    A run of n rows is taken whole when its (row x KV head) items share the `threads` no worse than one row
    alone does (`_rounds` a row, against those of the row cut as `decode_splits` says);
    else its largest part whose items divide evenly among the threads (the rest alone, where split-K may take
    them). SmolLM2-135M's 3 KV heads on 2 threads: pairs, 6 items, where one row alone leaves a thread idle a
    third of the time."""
    classes: dict[tuple, list[tuple[int, int]]] = {}
    for b, (k, v) in enumerate(kv):
        if k.dim() != 4 or k.shape[0] != 1 or v.shape != k.shape or v.stride() != k.stride():
            continue
        key = (tuple(k.shape), k.stride()[1:], k.dtype, k.untyped_storage().data_ptr(),
               v.untyped_storage().data_ptr(), v.storage_offset() - k.storage_offset())
        classes.setdefault(key, []).append((k.storage_offset(), b))
    groups: list[list[int]] = []
    for key, members in classes.items():
        if len(members) < 2:
            continue
        heads, context = key[0][1], key[0][2]
        splits = decode_splits(heads, context, threads if split_k else 1)
        alone_rounds = _rounds(splits, heads, threads)
        members.sort()
        runs: list[list[tuple[int, int]]] = []
        for offset, b in members:
            run = runs[-1] if runs else None
            if run and offset > run[-1][0] and (len(run) == 1 or offset - run[-1][0] == run[1][0] - run[0][0]):
                run.append((offset, b))
            else:
                runs.append([(offset, b)])
        for run in runs:
            n = len(run)
            if _rounds(n, heads, threads) > alone_rounds:
                even = max(threads, 1) // math.gcd(heads, max(threads, 1))  # rows whose items divide evenly
                n = n // even * even
            if n >= 2:
                groups.append([b for _, b in run[:n]])
    return groups


def _group_decode(q: Tensor, kv: list[tuple[Tensor, Tensor]], rows: list[int], scale: float) -> Tensor:
    """One token's attention for each of `rows` (a `row_groups` group) in one call: q [B, Hq, D] -> [n, Hq * D]."""
    k0, v0 = kv[rows[0]]
    num_kv_heads, context, head_dim = k0.shape[1], k0.shape[2], k0.shape[3]
    num_heads = q.shape[1]
    step = kv[rows[1]][0].storage_offset() - k0.storage_offset()
    size, stride = (len(rows), num_kv_heads, context, head_dim), (step, *k0.stride()[1:])
    keys = k0.as_strided(size, stride, k0.storage_offset())
    values = v0.as_strided(size, stride, v0.storage_offset())
    grouped = q.reshape(q.shape[0], num_kv_heads, num_heads // num_kv_heads, head_dim)
    grouped = grouped.index_select(0, torch.tensor(rows, device=q.device))
    out = _CPU_FLASH(grouped, keys, values, scale=scale)[0]
    return out.reshape(len(rows), num_heads * head_dim)


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
