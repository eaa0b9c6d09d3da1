"""The layer-aware block table: for every (request, layer), a tier and a list of block ids.

Each layer of a request lives on the device or on the host independently (section 6 of the paper).
All layers of a request hold the same number of tokens, so they use the same number of blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestBlocks:
    on_device: list[bool]  # per layer: True = device tier, False = host tier
    blocks: list[list[int]]  # per layer: block ids in that layer's tier, in token order
    evicted_layers: set[int] = field(default_factory=set)  # paused request: layers moved off device lazily

    @property
    def blocks_per_layer(self) -> int:
        return len(self.blocks[0]) if self.blocks else 0

    def host_blocks(self) -> int:
        """Blocks this request holds in the host pool."""
        return sum(len(b) for b, dev in zip(self.blocks, self.on_device) if not dev)
