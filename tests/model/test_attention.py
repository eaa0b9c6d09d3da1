import math

import pytest
import torch

from orbitflow.kv.pool import BlockPool
from orbitflow.model import attention
from orbitflow.model.attention import (
    DenseKVAttention,
    _grouped_decode,
    causal_attention,
    decode_attention,
    decode_splits,
    row_groups,
)


def naive_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    n, num_heads, head_dim = q.shape
    context, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    out = torch.empty(n, num_heads, head_dim, dtype=torch.float64)
    for i in range(n):
        visible = context - n + i + 1
        for h in range(num_heads):
            keys = k[:visible, h // group].double()
            scores = keys @ q[i, h].double() * scale
            out[i, h] = torch.softmax(scores, dim=0) @ v[:visible, h // group].double()
    return out.reshape(n, num_heads * head_dim).float()


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (6, 6), (8, 1)])
@pytest.mark.parametrize("n,context", [(1, 1), (1, 9), (7, 7), (3, 10), (5, 6)])
def test_causal_attention_matches_naive(n: int, context: int, num_heads: int, num_kv_heads: int) -> None:
    gen = torch.Generator().manual_seed(n * 100 + context)
    head_dim = 16
    q = torch.randn(n, num_heads, head_dim, generator=gen)
    k = torch.randn(context, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(context, num_kv_heads, head_dim, generator=gen)
    scale = 1 / math.sqrt(head_dim)
    got = causal_attention(q, k, v, scale)
    assert got.shape == (n, num_heads * head_dim)
    torch.testing.assert_close(got, naive_causal_attention(q, k, v, scale), atol=1e-5, rtol=1e-5)


def test_dense_backend_incremental_equals_full() -> None:
    """Chunked prefill + decode through the dense cache gives the same outputs as one full causal pass."""
    gen = torch.Generator().manual_seed(0)
    total, num_heads, num_kv_heads, head_dim = 12, 4, 2, 8
    q = torch.randn(total, num_heads, head_dim, generator=gen)
    k = torch.randn(total, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(total, num_kv_heads, head_dim, generator=gen)
    full = causal_attention(q, k, v, head_dim**-0.5)

    backend = DenseKVAttention(num_layers=1)
    pieces = []
    for start, end in [(0, 5), (5, 9), (9, 10), (10, 11), (11, 12)]:
        backend.set_batch(["a"], [end - start])
        pieces.append(backend(0, q[start:end], k[start:end], v[start:end]))
    torch.testing.assert_close(torch.cat(pieces), full, atol=1e-6, rtol=1e-6)
    assert backend.seq_len("a") == total
    backend.free("a")
    assert backend.seq_len("a") == 0


def test_dense_backend_packed_segments_are_independent() -> None:
    gen = torch.Generator().manual_seed(1)
    lengths = [3, 1, 6]
    q = torch.randn(sum(lengths), 4, 8, generator=gen)
    k = torch.randn(sum(lengths), 2, 8, generator=gen)
    v = torch.randn(sum(lengths), 2, 8, generator=gen)
    backend = DenseKVAttention(num_layers=2)
    backend.set_batch([10, 11, 12], lengths)
    packed = backend(1, q, k, v)
    start = 0
    for length in lengths:
        end = start + length
        alone = causal_attention(q[start:end], k[start:end], v[start:end], 8**-0.5)
        torch.testing.assert_close(packed[start:end], alone)
        start = end


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (6, 6)])
def test_decode_attention_rows_of_mixed_lengths_over_pool_views(num_heads: int, num_kv_heads: int) -> None:
    """One decode call over rows whose KV lengths differ (1 to 70 tokens), read as views of a paged pool: each
    row equals the naive attention over exactly its own tokens (a row that saw another's length, tokens or
    padding would not)."""
    gen = torch.Generator().manual_seed(7)
    head_dim, block = 16, 8
    lengths = [70, 1, 33, 8, 9]
    pool = BlockPool("device", 64, block, num_kv_heads, head_dim, address_blocks=128)
    q = torch.randn(len(lengths), num_heads, head_dim, generator=gen)
    views, expected = [], []
    for b, length in enumerate(lengths):
        ids = pool.allocate(-(-length // block)) if b % 2 == 0 else [int(x) for x in
                                                                     pool.allocate(-(-length // block))[::-1]]
        k = torch.randn(length, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(length, num_kv_heads, head_dim, generator=gen)
        pool.write(ids, 0, k, v)
        views.append(pool.heads_view(ids, length))  # odd rows: reversed ids, read by a gather
        expected.append(naive_causal_attention(q[b:b + 1], k, v, head_dim**-0.5))
    got = decode_attention(q, views, head_dim**-0.5)
    assert got.shape == (len(lengths), num_heads * head_dim)
    torch.testing.assert_close(got, torch.cat(expected), atol=1e-5, rtol=1e-5)
    for b, (k4, v4) in enumerate(views):  # and bit-identical to the prefill/chunk path on the same KV
        alone = causal_attention(q[b:b + 1], k4[0].transpose(0, 1), v4[0].transpose(0, 1), head_dim**-0.5)
        assert torch.equal(got[b:b + 1], alone)


@pytest.mark.parametrize("num_kv_heads,context,threads,splits", [
    (3, 8192, 2, 2),  # SmolLM2-135M on 2 threads: 3 items a call would keep one thread idle a third of the time
    (3, 8192, 4, 4),  # 12 items on 4 threads (2 or 3 stretches would take as long as none)
    (3, 3000, 4, 1),  # 2 stretches of 1500: 6 items on 4 threads, no sooner than 3
    (3, 8192, 16, 5),  # 15 items: a fifth of a row each; 8 stretches (24 items, 2 rounds) would take a quarter
    (1, 8192, 2, 2),  # one KV head per tensor-parallel rank
    (3, 2047, 2, 1),  # a stretch would be shorter than SPLIT_MIN_TOKENS
    (3, 8192, 1, 1), (4, 8192, 2, 1), (2, 8192, 4, 2),  # one thread, or heads that already divide evenly
])
def test_decode_splits_finish_soonest(num_kv_heads, context, threads, splits) -> None:
    assert attention.SPLIT_MIN_TOKENS == 1024
    assert decode_splits(num_kv_heads, context, threads) == splits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [2, 3, 5, 200])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (4, 4)])
def test_split_decode_matches_naive_over_pool_views(splits: int, num_heads: int, num_kv_heads: int, dtype) -> None:
    """Split-K (stretches of a row's keys as one batched call, merged by logsumexp) equals the naive attention
    over the whole row, in the KV's dtype: lengths that leave a tail, a row shorter than the splits, views of a
    run, gathered copies and staged copies alike."""
    gen = torch.Generator().manual_seed(splits)
    head_dim, block = 16, 8
    lengths = [70, 33, 3, 16, 1]
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    pool = BlockPool("device", 64, block, num_kv_heads, head_dim, dtype=dtype, address_blocks=128)
    for b, length in enumerate(lengths):
        ids = pool.allocate(-(-length // block))
        if b % 2:
            ids = [int(x) for x in ids[::-1]]
        k = torch.randn(length, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(length, num_kv_heads, head_dim, generator=gen).to(dtype)
        pool.write(ids, 0, k, v)
        q = torch.randn(1, num_heads, head_dim, generator=gen).to(dtype)
        expected = naive_causal_attention(q, k, v, head_dim**-0.5)
        # the pool's view (or a gathered copy), and a staged copy's layout ([C, Hkv, D] read as [1, Hkv, C, D])
        for k4, v4 in (pool.heads_view(ids, length), (k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0))):
            got = _grouped_decode(q, k4, v4, head_dim**-0.5, splits)
            assert got.dtype == dtype
            torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=tolerance)


def _pool_rows(pool: BlockPool, lengths: list[int], num_kv_heads: int, head_dim: int, gen, spacing: int | None = None,
               reverse: tuple[int, ...] = ()) -> tuple[list, list]:
    """Rows written into `pool`: each a run (at multiples of `spacing` blocks when given, else where the pool puts
    it), or reversed ids (read by a gather) for the rows in `reverse`. Returns (views, (k, v) per row)."""
    views, data = [], []
    block = pool.block_size
    for b, length in enumerate(lengths):
        n = -(-length // block)
        ids = list(range(b * spacing, b * spacing + n)) if spacing else pool.allocate(n)
        if b in reverse:
            ids = ids[::-1]
        k = torch.randn(length, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(length, num_kv_heads, head_dim, generator=gen)
        pool.write(ids, 0, k, v)
        views.append(pool.heads_view(ids, length))
        data.append((k, v))
    return views, data


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_row_groups_take_a_whole_run_of_short_rows(threads) -> None:
    gen = torch.Generator().manual_seed(3)
    pool = BlockPool("device", 64, 8, 3, 16, address_blocks=64)
    views, _ = _pool_rows(pool, [40] * 3, 3, 16, gen, spacing=8)
    # one row alone: ceil(3 / threads) rounds of items; the run of 3, ceil(9 / threads) / 3 rounds a row, no more
    assert row_groups(views, threads) == [[0, 1, 2]]


@pytest.mark.parametrize("rows,expected", [(3, [[0, 1]]), (4, [[0, 1, 2, 3]]), (2, [[0, 1]])])
def test_row_groups_keep_an_even_share_where_split_k_would(monkeypatch, rows, expected) -> None:
    """Rows long enough to split: on 2 threads one row's 3 KV heads in 2 stretches share the threads evenly, so a
    run is cut to the rows whose items divide evenly (3 rows: 2 together, the third alone and split); without
    split-K (a step with copies) the whole run goes in one call."""
    monkeypatch.setattr(attention, "SPLIT_MIN_TOKENS", 8)
    gen = torch.Generator().manual_seed(5)
    pool = BlockPool("device", 64, 8, 3, 16, address_blocks=64)
    views, _ = _pool_rows(pool, [40] * rows, 3, 16, gen, spacing=8)
    assert decode_splits(3, 40, 2) == 2
    assert row_groups(views, 2) == expected
    assert row_groups(views, 2, split_k=False) == [list(range(rows))]


def test_row_groups_leave_out_what_one_call_cannot_take() -> None:
    gen = torch.Generator().manual_seed(4)
    pool = BlockPool("device", 64, 8, 3, 16, address_blocks=64)
    # rows 0, 1, 3 share a length; row 2 differs; row 4 is a gathered copy (reversed ids)
    views, _ = _pool_rows(pool, [40, 40, 33, 40, 40], 3, 16, gen, spacing=8, reverse=(4,))
    # 0 -> 1 -> 3 is not evenly spaced (8 then 16 blocks): the run is 0, 1, and 3 stays alone
    assert row_groups(views, 1) == [[0, 1]]
    assert row_groups([views[b] for b in (3, 0, 1)], 1) == [[1, 2]]  # offset order, not batch order
    staged = [(k.clone(), v.clone()) for k, v in views]  # separate tensors: nothing to group
    assert row_groups(staged, 1) == []
    assert row_groups(views[:1], 1) == []
    # K evenly spaced in one tensor, V in another at other spacings: no stride of one batch dimension fits both
    keys, values = torch.randn(1, 3, 300, 16, generator=gen), torch.randn(1, 3, 300, 16, generator=gen)
    rows = [(keys[:, :, 0:40], values[:, :, 0:40]), (keys[:, :, 100:140], values[:, :, 200:240])]
    assert row_groups(rows, 1) == []
    rows[1] = (keys[:, :, 100:140], values[:, :, 100:140])
    assert row_groups(rows, 1) == [[0, 1]]


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (4, 2)])
def test_grouped_rows_equal_their_own_calls_bit_for_bit(threads, num_heads, num_kv_heads) -> None:
    """decode_attention over rows that row_groups batches (equal lengths at even spacing, beside rows of other
    lengths, a gathered row and an uneven spacing): every row equals the naive attention over its own tokens, and
    `causal_attention` of the row alone bit for bit (the rows are short, so neither splits)."""
    gen = torch.Generator().manual_seed(threads * 10 + num_kv_heads)
    head_dim = 16
    lengths = [40, 40, 33, 40, 40, 40, 7]
    pool = BlockPool("device", 128, 8, num_kv_heads, head_dim, address_blocks=128)
    views, data = _pool_rows(pool, lengths, num_kv_heads, head_dim, gen, spacing=8, reverse=(3,))
    # make the spacing uneven for row 5: move it two blocks on
    k5, v5 = data[5]
    ids = list(range(5 * 8 + 2, 5 * 8 + 2 + 5))
    pool.write(ids, 0, k5, v5)
    views[5] = pool.heads_view(ids, 40)
    q = torch.randn(len(lengths), num_heads, head_dim, generator=gen)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        groups = row_groups(views, threads)
        assert groups and all(len(g) >= 2 for g in groups), "nothing grouped: the test would prove nothing"
        got = decode_attention(q, views, head_dim**-0.5)
        alone = [causal_attention(q[b:b + 1], k4[0].transpose(0, 1), v4[0].transpose(0, 1), head_dim**-0.5)
                 for b, (k4, v4) in enumerate(views)]
    finally:
        torch.set_num_threads(previous)
    expected = torch.cat([naive_causal_attention(q[b:b + 1], k, v, head_dim**-0.5) for b, (k, v) in enumerate(data)])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    for b in range(len(lengths)):
        assert torch.equal(got[b:b + 1], alone[b]), b
