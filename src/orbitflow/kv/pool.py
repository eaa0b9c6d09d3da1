"""A fixed-size pool of KV blocks on one memory tier.

One block holds K and V of `block_size` tokens for ONE layer: shape [2, block_size, kv_heads, head_dim].
Blocks of every layer and every request share the pool (the paper's flattened 1D layout, section 6);
the layer-aware block table says which block belongs to which (request, layer).
"""

from __future__ import annotations

import threading

import torch


class OutOfBlocks(RuntimeError):
    """The pool cannot satisfy an allocation."""

    def __init__(self, tier: str, wanted: int, free: int, total: int):
        super().__init__(f"{tier} KV pool exhausted: wanted {wanted} blocks, {free} free of {total}")
        self.tier, self.wanted, self.free, self.total = tier, wanted, free, total


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
    ):
        self.tier = tier
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_blocks, 2, block_size, num_kv_heads, head_dim)
        # torch.empty does not touch the pages, so a large host pool costs nothing until used.
        # An unmaterialized pool only counts blocks (the simulator's executor).
        self.storage = torch.empty(shape, dtype=dtype, device=device, pin_memory=pin_memory) if materialize else None
        self.bytes_per_block = 2 * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: pop() hands out low ids first
        self._lock = threading.Lock()
        self.peak_used = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        with self._lock:
            if n > len(self._free):
                raise OutOfBlocks(self.tier, n, len(self._free), self.num_blocks)
            ids = [self._free.pop() for _ in range(n)]
            self.peak_used = max(self.peak_used, self.num_used)
            return ids

    def free(self, ids: list[int]) -> None:
        if not ids:
            return
        with self._lock:
            self._free.extend(reversed(ids))

    def reset_peak(self) -> None:
        self.peak_used = self.num_used
