"""The KV manager: owns both pools and the layer-aware block table, and enforces placements.

- `allocate(req, num_tokens, on_device)`: blocks for a new request, each layer in its own tier.
- `grow(req, num_tokens)`: grow every layer by whole blocks, in that layer's tier, so new
  tokens of a host-resident layer go straight to the host.
- `can_allocate(...)`: whether both pools can hold a set of requests to their last token (admission).
Expected shortage is a return value (`allocate` -> None, `grow`/`apply_placements`/`make_room` -> `Shortage`),
never an exception; `OutOfBlocks` from a pool means a caller skipped that answer (a bug).
- `apply_placement(req, on_device)`: move only the layers whose tier changed.
- `pause(req)` / eviction: a paused request keeps its device layers until their space is needed
  (the paper's removable cache); `make_room(n)` then moves them to the host layer by layer.
- `free(req)`: return every block of a request to its pool; safe to call more than once.
"""

from __future__ import annotations

import math

import torch

from orbitflow.kv.block_table import RequestBlocks
from orbitflow.kv.pool import BlockPool, Shortage, is_run
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
        # On the CPU the device tier gets twice its budget in block addresses (untouched pages cost nothing),
        # so a request's layer can grow as one run and attention reads it as a view. On CUDA, memory is
        # real: addresses = budget, and runs that cannot grow in place are relocated or gathered.
        spare = 2 * device_blocks if materialize and device.type == "cpu" else device_blocks
        self.device_pool = BlockPool(
            "device", device_blocks, block_size, num_kv_heads, head_dim, dtype, device, materialize=materialize,
            address_blocks=spare,
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
    # Where blocks may run short, the answer is a value: `allocate` returns None, `grow`, `apply_placements` and
    # `make_room` return the `Shortage` (None when done). A pool raising OutOfBlocks is a caller's bug.
    def can_allocate(self, needed_blocks: float, holders: list) -> bool:
        """Whether both pools together can hold `needed_blocks` blocks (over every layer, e.g. the planner's
        `placement.most_blocks` for some requests grown to their last token), given that `holders` (request
        ids) already hold some of those blocks."""
        free = self.device_pool.num_free + self.host_pool.num_free
        held = sum(self.tables[r].blocks_per_layer for r in holders if r in self.tables)
        return needed_blocks <= free + held * self.num_layers

    def allocate(self, req_id: object, num_tokens: int, on_device: list[bool]) -> RequestBlocks | None:
        """Blocks for a new request, each layer in its tier; None (and nothing held) when they run short."""
        if req_id in self.tables:
            raise KeyError(f"request {req_id!r} already has KV blocks")
        table = RequestBlocks(on_device=list(on_device), blocks=[[] for _ in range(self.num_layers)])
        self.tables[req_id] = table
        if self.grow(req_id, num_tokens) is not None:
            self.free(req_id)
            return None
        return table

    def grow(self, req_id: object, num_tokens: int) -> Shortage | None:
        """Make every layer of the request hold at least `num_tokens` tokens' worth of blocks.

        A layer's blocks grow in place when the ids after its run are free; a device layer that cannot is
        moved to a fresh run (one local copy) when the budget allows, else it takes any free blocks (read
        by a gather). Either way the request's tokens stay readable and the budget is checked up front,
        so a shortage leaves the table as it was (paused requests' layers may have been evicted)."""
        table = self.tables[req_id]
        need = self.blocks_for(num_tokens) - table.blocks_per_layer
        if need <= 0:
            return None
        device_layers = sum(table.on_device)
        short = self.make_room(need * device_layers, exclude=req_id)
        if short is not None:
            return short
        for pool, layers in ((self.device_pool, device_layers), (self.host_pool, self.num_layers - device_layers)):
            if need * layers > pool.num_free:
                return Shortage(pool.tier, need * layers, pool.num_free, pool.num_blocks)
        for layer, dev in enumerate(table.on_device):
            self._grow_layer(table, layer, dev, need)
        return None

    def _grow_layer(self, table: RequestBlocks, layer: int, on_device: bool, need: int) -> None:
        pool, old = self.pool(on_device), table.blocks[layer]
        if not old:
            table.blocks[layer] = pool.allocate(need)
            return
        grown = pool.extend(old[-1], need)
        if grown is not None:
            old.extend(grown)
            return
        if on_device and pool.storage is not None and pool.num_free >= len(old) + need and is_run(old):
            run = pool.allocate(len(old) + need)
            if is_run(run):  # relocate: one copy inside the device tier, then the run grows again
                pool.storage[:, run[0]:run[0] + len(old)] = pool.storage[:, old[0]:old[0] + len(old)]
                self.transfer.free_after_compute(pool, old)  # the copy above may still be queued
                table.blocks[layer] = run
                return
            pool.free(run)
        old.extend(pool.allocate(need))

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
    def apply_placement(self, req_id: object, on_device: list[bool]) -> Shortage | None:
        return self.apply_placements({req_id: on_device})

    def apply_placements(self, rows: dict[object, list[bool]]) -> Shortage | None:
        """Move only the layers whose tier changes. Moves go in rounds: each round does every move whose
        destination has room, so a move to the host can wait for one to the device to free host blocks
        and the other way round. Returns the Shortage when no move can proceed (the moves done stay done)."""
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
                if to_device and (short := self.make_room(need, exclude=req_id)) is not None:
                    return short
                if self.pool(to_device).num_free >= need:
                    self._move_layer(table, layer, to_device)
                else:
                    waiting.append((req_id, layer, to_device))
            if len(waiting) == len(pending):
                req_id, _, to_device = waiting[0]
                pool = self.pool(to_device)
                return Shortage(pool.tier, self.tables[req_id].blocks_per_layer, pool.num_free, pool.num_blocks)
            pending = waiting
        for req_id in rows:
            self.tables[req_id].evicted_layers.clear()
        return None

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

    def make_room(self, blocks: int, exclude: object = None) -> Shortage | None:
        """Evict paused requests' device layers (last layer first) until `blocks` device blocks are free.
        Returns the host Shortage when an evicted layer has nowhere to go (else None, even if not enough
        was evictable: the caller checks the device pool)."""
        for req_id in list(self.paused):
            if self.device_pool.num_free >= blocks:
                return None
            if req_id == exclude:
                continue
            table = self.tables[req_id]
            for layer in reversed(range(self.num_layers)):
                if self.device_pool.num_free >= blocks:
                    return None
                if table.on_device[layer]:
                    host = self.host_pool
                    if len(table.blocks[layer]) > host.num_free:
                        return Shortage(host.tier, len(table.blocks[layer]), host.num_free, host.num_blocks)
                    self._move_layer(table, layer, to_device=False)
                    table.evicted_layers.add(layer)
        return None

    # ---- reading and writing KV -------------------------------------------------------------------
    def write(self, req_id: object, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V of tokens start..start+n-1 of one layer into that layer's tier."""
        table = self.tables[req_id]
        if not table.on_device[layer]:  # device-to-host: an async copy fenced by its event, never a sync
            self.transfer.write_host(table.blocks[layer], start, k, v)
            return
        pool = self.device_pool
        k, v = k.to(pool.storage.device, pool.storage.dtype), v.to(pool.storage.device, pool.storage.dtype)
        pool.write(table.blocks[layer], start, k, v)

    def layer_kv(self, req_id: object, layer: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [num_tokens, kv_heads, head_dim] of a device-resident layer, read where they live (views)."""
        return self.device_pool.kv_view(self.tables[req_id].blocks[layer], num_tokens)

    def append_staged(
        self, staged: list[int] | torch.Tensor, start: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append new tokens' K/V to a staged copy of a host-resident layer (its slot was sized for them) and
        return K, V of all start + n tokens as views of that copy: the staged copy is the only copy."""
        total = start + k.shape[0]
        if isinstance(staged, torch.Tensor):  # an overflowed slot: scratch [2, blocks, block_size, heads, dim]
            heads = staged.shape[3:]
            keys, values = staged[0].view(-1, *heads), staged[1].view(-1, *heads)
            keys[start:total], values[start:total] = k, v
            return keys[:total], values[:total]
        self.device_pool.write(staged, start, k, v)
        return self.device_pool.kv_view(staged, total)

    def block_index(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        """Index tensor of the device-pool blocks that hold `num_tokens` tokens."""
        return torch.tensor(block_ids[: self.blocks_for(num_tokens)], dtype=torch.long,
                            device=self.device_pool.storage.device)

    def read(self, blocks: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of K, V [num_tokens, kv_heads, head_dim] from a device-pool block index (`block_index`) or
        from a scratch tensor of blocks [2, n, block_size, kv_heads, head_dim]. For inspection and tests:
        the executor reads views (`layer_kv`, `append_staged`)."""
        storage = self.device_pool.storage
        heads = storage.shape[3:]
        kv = storage.index_select(1, blocks) if blocks.dtype == torch.long else blocks
        return kv[0].reshape(-1, *heads)[:num_tokens], kv[1].reshape(-1, *heads)[:num_tokens]

    def close(self) -> None:
        self.transfer.close()
