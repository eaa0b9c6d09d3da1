"""The KV manager: owns both pools and the layer-aware block table, and enforces placements.

- `allocate(req, num_tokens, on_device)`: blocks for a new request, each layer in its own tier.
- `ensure_capacity(req, num_tokens)`: grow every layer by whole blocks, in that layer's tier, so new
  tokens of a host-resident layer go straight to the host.
- `apply_placement(req, on_device)`: move only the layers whose tier changed.
- `pause(req)` / eviction: a paused request keeps its device layers until their space is needed
  (the paper's removable cache); `make_room(n)` then moves them to the host layer by layer.
- `free(req)`: return every block of a request to its pool; safe to call more than once.
"""

from __future__ import annotations

import math

import torch

from orbitflow.kv.block_table import RequestBlocks
from orbitflow.kv.pool import BlockPool, OutOfBlocks
from orbitflow.kv.transfer import TransferEngine


class KVManager:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        device_blocks: int,
        host_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        link_bytes_per_s: float | None = None,
        materialize: bool = True,
    ):
        device = torch.device(device)
        self.num_layers = num_layers
        self.block_size = block_size
        self.device_pool = BlockPool(
            "device", device_blocks, block_size, num_kv_heads, head_dim, dtype, device, materialize=materialize
        )
        self.host_pool = BlockPool(
            "host", host_blocks, block_size, num_kv_heads, head_dim, dtype, "cpu",
            pin_memory=materialize and device.type == "cuda", materialize=materialize,
        )
        self.transfer = TransferEngine(self.device_pool, self.host_pool, link_bytes_per_s)
        self.tables: dict[object, RequestBlocks] = {}
        self.paused: list[object] = []  # paused requests whose device layers may be evicted, oldest first

    # ---- sizes -----------------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def pool(self, on_device: bool) -> BlockPool:
        return self.device_pool if on_device else self.host_pool

    def usage(self) -> tuple[int, int]:
        return self.device_pool.num_used, self.host_pool.num_used

    # ---- allocation ------------------------------------------------------------------------------
    def allocate(self, req_id: object, num_tokens: int, on_device: list[bool]) -> RequestBlocks:
        if req_id in self.tables:
            raise KeyError(f"request {req_id!r} already has KV blocks")
        table = RequestBlocks(on_device=list(on_device), blocks=[[] for _ in range(self.num_layers)])
        self.tables[req_id] = table
        try:
            self.ensure_capacity(req_id, num_tokens)
        except OutOfBlocks:
            self.free(req_id)
            raise
        return table

    def ensure_capacity(self, req_id: object, num_tokens: int) -> None:
        """Make every layer of the request hold at least `num_tokens` tokens' worth of blocks."""
        table = self.tables[req_id]
        need = self.blocks_for(num_tokens) - table.blocks_per_layer
        if need <= 0:
            return
        device_layers = sum(table.on_device)
        self.make_room(need * device_layers, exclude=req_id)
        new_device = self.device_pool.allocate(need * device_layers)
        try:
            new_host = self.host_pool.allocate(need * (self.num_layers - device_layers))
        except OutOfBlocks:
            self.device_pool.free(new_device)
            raise
        for layer, dev in enumerate(table.on_device):
            source = new_device if dev else new_host
            table.blocks[layer].extend(source[:need])
            del source[:need]

    def free(self, req_id: object) -> None:
        table = self.tables.pop(req_id, None)
        if req_id in self.paused:
            self.paused.remove(req_id)
        if table is None:
            return
        for layer, dev in enumerate(table.on_device):
            self.pool(dev).free(table.blocks[layer])
            table.blocks[layer] = []

    # ---- placement -------------------------------------------------------------------------------
    def apply_placement(self, req_id: object, on_device: list[bool]) -> None:
        self.apply_placements({req_id: on_device})

    def apply_placements(self, rows: dict[object, list[bool]]) -> None:
        """Move only the layers whose tier changes. Moves go in rounds: each round does every move whose
        destination has room, so a move to the host can wait for one to the device to free host blocks
        and the other way round. Raises OutOfBlocks when no move can proceed."""
        for req_id in rows:
            if req_id in self.paused:
                self.paused.remove(req_id)
        pending = [(req_id, layer, want) for req_id, want_row in rows.items()
                   for layer, want in enumerate(want_row) if self.tables[req_id].on_device[layer] != want]
        while pending:
            waiting = []
            for req_id, layer, to_device in pending:
                table = self.tables[req_id]
                need = table.blocks_per_layer
                if to_device:
                    self.make_room(need, exclude=req_id)
                if self.pool(to_device).num_free >= need:
                    self._move_layer(table, layer, to_device)
                else:
                    waiting.append((req_id, layer, to_device))
            if len(waiting) == len(pending):
                req_id, _, to_device = waiting[0]
                pool = self.pool(to_device)
                raise OutOfBlocks(pool.tier, self.tables[req_id].blocks_per_layer, pool.num_free, pool.num_blocks)
            pending = waiting
        for req_id in rows:
            self.tables[req_id].evicted_layers.clear()

    def _move_layer(self, table: RequestBlocks, layer: int, to_device: bool) -> None:
        old = table.blocks[layer]
        new = self.pool(to_device).allocate(len(old))
        if old:
            if to_device:
                self.transfer.move_to_device(old, new)
            else:
                self.transfer.move_to_host(old, new)
        self.pool(not to_device).free(old)
        table.blocks[layer] = new
        table.on_device[layer] = to_device

    def pause(self, req_id: object) -> None:
        """Keep the request's KV where it is; its device layers become evictable on demand."""
        if req_id not in self.paused:
            self.paused.append(req_id)

    def make_room(self, blocks: int, exclude: object = None) -> None:
        """Evict paused requests' device layers (last layer first) until `blocks` device blocks are free."""
        for req_id in list(self.paused):
            if self.device_pool.num_free >= blocks:
                return
            if req_id == exclude:
                continue
            table = self.tables[req_id]
            for layer in reversed(range(self.num_layers)):
                if self.device_pool.num_free >= blocks:
                    return
                if table.on_device[layer]:
                    self._move_layer(table, layer, to_device=False)
                    table.evicted_layers.add(layer)

    # ---- reading and writing KV -------------------------------------------------------------------
    def write(self, req_id: object, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V of tokens start..start+n-1 of one layer into that layer's tier."""
        table = self.tables[req_id]
        pool = self.pool(table.on_device[layer]).storage
        k, v = k.to(pool.device, pool.dtype), v.to(pool.device, pool.dtype)
        if k.shape[0] == 1:  # decode: one slot, no index tensors to build
            block, offset = divmod(start, self.block_size)
            pool[table.blocks[layer][block], 0, offset] = k[0]
            pool[table.blocks[layer][block], 1, offset] = v[0]
            return
        positions = torch.arange(start, start + k.shape[0])
        block_ids = torch.tensor(table.blocks[layer], dtype=torch.long)[positions // self.block_size]
        offsets = positions % self.block_size
        block_ids, offsets = block_ids.to(pool.device), offsets.to(pool.device)
        pool[block_ids, 0, offsets] = k
        pool[block_ids, 1, offsets] = v

    def block_index(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        """Index tensor of the device-pool blocks that hold `num_tokens` tokens."""
        return torch.tensor(block_ids[: self.blocks_for(num_tokens)], dtype=torch.long,
                            device=self.device_pool.storage.device)

    def read(self, blocks: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [num_tokens, kv_heads, head_dim] from a device-pool block index (`block_index`; resident or
        staged blocks) or from a scratch tensor of blocks [n, 2, block_size, kv_heads, head_dim] (an
        overflowed prefetch)."""
        storage = self.device_pool.storage
        heads = storage.shape[3:]
        if blocks.dtype == torch.long:  # gather K and V separately: each lands contiguous, no extra copy
            k = storage[:, 0].index_select(0, blocks).view(-1, *heads)
            v = storage[:, 1].index_select(0, blocks).view(-1, *heads)
        else:
            k, v = blocks[:, 0].reshape(-1, *heads), blocks[:, 1].reshape(-1, *heads)
        return k[:num_tokens], v[:num_tokens]

    def close(self) -> None:
        self.transfer.close()
