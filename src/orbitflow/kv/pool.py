"""A fixed-size pool of KV blocks on one memory tier.

One block holds K and V of `block_size` tokens for ONE layer. Blocks of every layer and every request share
the pool (the paper's flattened 1D layout, section 6); the layer-aware block table says which block belongs
to which (request, layer).

Storage is indexed as `[2 (K, V), address_blocks, block_size, kv_heads, head_dim]` but laid out head-major in
memory, `[2, kv_heads, address_blocks, block_size, head_dim]` (`block_tensor`): the K (or V) of a run of
consecutive block ids is a `[tokens, kv_heads, head_dim]` view whose every head is one contiguous
`[tokens, head_dim]` stretch, the layout attention kernels read fastest (transformers' `[batch, heads, tokens,
head_dim]` cache has it too; token-major blocks made each decode attention call ~1.6x slower on the CPU).
Attention reads a request's KV where it lives, without gathering it. To keep runs consecutive while requests
grow, the pool may own more block addresses than its budget (`address_blocks`): `num_blocks` is what may be
in use at once (the budget the planner sees), the extra addresses only give runs room to grow in place.
`torch.empty` does not touch pages, so an address that is never written costs no memory.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from orbitflow.kv.events import device_index


@dataclass(frozen=True)
class Shortage:
    """An expected answer, not an error: a tier cannot give `wanted` blocks now (the caller pauses, waits or
    re-plans). `KVManager` returns it (or None) where blocks may run short."""

    tier: str
    wanted: int
    free: int
    total: int

    def __str__(self) -> str:
        return f"{self.tier} KV pool exhausted: wanted {self.wanted} blocks, {self.free} free of {self.total}"


class OutOfBlocks(RuntimeError):
    """A pool was asked for more blocks than it has free: a caller skipped its check (a bug)."""

    def __init__(self, tier: str, wanted: int, free: int, total: int):
        self.shortage = Shortage(tier, wanted, free, total)
        super().__init__(str(self.shortage))
        self.tier, self.wanted, self.free, self.total = tier, wanted, free, total


def block_bytes(block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block of one layer (K and V)."""
    return 2 * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def block_tensor(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, pin_memory: bool = False) -> torch.Tensor:
    """Uninitialised KV blocks indexed `[2, num_blocks, block_size, kv_heads, head_dim]`, stored head-major
    (`head_planes` gives the storage order back)."""
    planes = torch.empty((2, num_kv_heads, num_blocks, block_size, head_dim), dtype=dtype, device=device,
                         pin_memory=pin_memory)
    return planes.permute(0, 2, 3, 1, 4)


def head_planes(blocks: torch.Tensor) -> torch.Tensor:
    """`[2, kv_heads, num_blocks, block_size, head_dim]` view of a `block_tensor`: in storage order, so
    `head_planes(t)[plane, head, first:last]` is contiguous (a copy of it is one memcpy, or one DMA)."""
    return blocks.permute(0, 3, 1, 2, 4)


def is_run(ids: list[int]) -> bool:
    """True when `ids` are consecutive block ids in increasing order (their K and V are views)."""
    return not ids or ids == list(range(ids[0], ids[0] + len(ids)))


class BlockPool:
    def __init__(
        self,
        tier: str,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        pin_memory: bool = False,
        materialize: bool = True,
        address_blocks: int | None = None,
    ):
        self.tier = tier
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.address_blocks = max(num_blocks, address_blocks or num_blocks)
        # torch.empty does not touch the pages, so a large pool costs nothing until used.
        # An unmaterialized pool only counts blocks (the simulator's executor).
        self.storage = block_tensor(self.address_blocks, block_size, num_kv_heads, head_dim, dtype, device,
                                    pin_memory) if materialize else None
        self.bytes_per_block = block_bytes(block_size, num_kv_heads, head_dim, dtype)
        self._used = np.zeros(self.address_blocks, dtype=bool)
        self._num_used = 0
        self._lock = threading.Lock()
        self.peak_used = 0

    @property
    def num_free(self) -> int:
        return self.num_blocks - self._num_used

    @property
    def num_used(self) -> int:
        return self._num_used

    def allocate(self, n: int, placement: Literal["grow", "first"] = "grow") -> list[int]:
        """`n` blocks, consecutive ids when the address space has such a run free.

        placement "grow" (a run that will grow: a request's layer) starts the run in the middle of the
        largest free gap, leaving room after both it and its left neighbour; "first" (a run that will not
        grow: a staging slot) takes the lowest free run, so its pages are reused step after step.
        """
        with self._lock:
            if n > self.num_free:
                raise OutOfBlocks(self.tier, n, self.num_free, self.num_blocks)
            ids = self._find_run(n, placement) if n else []
            if ids is None:  # fragmented: any free addresses, lowest first
                ids = np.flatnonzero(~self._used)[:n].tolist()
            self._used[ids] = True
            self._num_used += n
            self.peak_used = max(self.peak_used, self._num_used)
            return ids

    def extend(self, last: int, n: int) -> list[int] | None:
        """The `n` ids right after block `last` if they are free (a run grows in place), else None."""
        with self._lock:
            if n > self.num_free:
                raise OutOfBlocks(self.tier, n, self.num_free, self.num_blocks)
            lo, hi = last + 1, last + 1 + n
            if hi > self.address_blocks or self._used[lo:hi].any():
                return None
            self._used[lo:hi] = True
            self._num_used += n
            self.peak_used = max(self.peak_used, self._num_used)
            return list(range(lo, hi))

    def _find_run(self, n: int, placement: str) -> list[int] | None:
        free = np.concatenate(([False], ~self._used, [False])).view(np.int8)
        edges = np.diff(free)
        starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        lengths = ends - starts
        if placement == "first":
            fits = np.flatnonzero(lengths >= n)
            if not len(fits):
                return None
            start = int(starts[fits[0]])
        else:
            best = int(lengths.argmax()) if len(lengths) else -1
            if best < 0 or lengths[best] < n:
                return None
            start = int(starts[best])
            if start > 0:  # a run ends where this gap starts: leave it half the room to grow into
                start += int(lengths[best] - n) // 2
        return list(range(start, start + n))

    def free(self, ids: list[int]) -> None:
        if not ids:
            return
        with self._lock:
            if is_run(ids):  # the usual case (a run, a staging slot): slices, and its ids are distinct
                idx = slice(ids[0], ids[0] + len(ids))
                ok = bool(self._used[idx].all())
            else:
                idx = np.asarray(ids)
                ok = bool(self._used[idx].all()) and np.unique(idx).size == idx.size
            if not ok:  # a bug, never an expected shortage
                raise ValueError(f"{self.tier} pool: freeing blocks that are not allocated (or twice): {ids}")
            self._used[idx] = False
            self._num_used -= len(ids)

    def reset_peak(self) -> None:
        self.peak_used = self.num_used

    # ---- data -----------------------------------------------------------------------------------
    def kv_view(self, ids: list[int], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [num_tokens, kv_heads, head_dim] of the first tokens of a block list: views of the pool when
        the ids form a run, else gathered copies (a fragmented allocation)."""
        heads = self.storage.shape[3:]
        nblocks = -(-num_tokens // self.block_size)
        ids = ids[:nblocks]
        if is_run(ids):
            first = ids[0] if ids else 0
            kv = self.storage[:, first:first + nblocks]
            return kv[0].view(-1, *heads)[:num_tokens], kv[1].view(-1, *heads)[:num_tokens]
        index = device_index(ids, self.storage.device)
        kv = self.storage.index_select(1, index)
        return kv[0].view(-1, *heads)[:num_tokens], kv[1].view(-1, *heads)[:num_tokens]

    def heads_view(self, ids: list[int], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [1, kv_heads, num_tokens, head_dim] (SDPA's layout, one contiguous stretch per head) of the first
        tokens of a block list: one strided view each when the ids form a run, else gathered copies."""
        nblocks = -(-num_tokens // self.block_size)
        if not is_run(ids[:nblocks]):
            k, v = self.kv_view(ids, num_tokens)
            return k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        storage = self.storage
        plane, _, token, head, _ = storage.stride()
        size = (1, storage.shape[3], num_tokens, storage.shape[4])
        stride = (head * storage.shape[3], head, token, 1)
        offset = storage.storage_offset() + ids[0] * self.block_size * token if ids else 0
        return storage.as_strided(size, stride, offset), storage.as_strided(size, stride, offset + plane)

    def write(self, ids: list[int], start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V [n, kv_heads, head_dim] of tokens start..start+n-1 of a block list: one slice copy when
        the blocks they fall in form a run (always for a single token), else one indexed write."""
        n, bs = k.shape[0], self.block_size
        first, last = start // bs, (start + n - 1) // bs
        span = ids[first:last + 1]
        if is_run(span):
            heads = self.storage.shape[3:]
            offset = start - first * bs
            kv = self.storage[:, span[0]:span[0] + len(span)]
            kv[0].view(-1, *heads)[offset:offset + n] = k
            kv[1].view(-1, *heads)[offset:offset + n] = v
            return
        positions = torch.arange(start, start + n)
        block_ids = device_index(torch.tensor(ids, dtype=torch.long)[positions // bs].tolist(), self.storage.device)
        offsets = device_index((positions % bs).tolist(), self.storage.device)
        self.storage[0, block_ids, offsets] = k
        self.storage[1, block_ids, offsets] = v
