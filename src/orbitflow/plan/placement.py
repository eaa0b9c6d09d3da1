"""KV placement: a boolean matrix ``x[r, l]`` (True = layer ``l`` of request ``r`` stays on the device).

Distance-driven rows (the paper's pruned space) offload the 1-based layers ``d, 2d, 3d, ...``;
``d=None`` offloads nothing and ``d=1`` offloads everything (DeepSpeed-style).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

__all__ = ["Placement", "capacity_terms", "distance_row", "memory_blocks", "most_blocks", "pruned_distances",
           "widest_distance"]


def distance_row(num_layers: int, distance: int | None) -> np.ndarray:
    """Device mask (True = on device) of one request offloading every ``distance``-th layer."""
    row = np.ones(num_layers, dtype=bool)
    if distance is not None:
        if distance < 1:
            raise ValueError(f"offload distance must be >= 1 or None, got {distance}")
        row[distance - 1 :: distance] = False
    return row


def widest_distance(num_layers: int, count: int) -> int | None:
    """Largest distance ``d`` that offloads exactly ``count`` layers (``None`` for 0)."""
    if count == 0:
        return None
    if not 1 <= count <= num_layers:
        raise ValueError(f"offload count must be in [0, {num_layers}], got {count}")
    return num_layers // count


def pruned_distances(num_layers: int) -> list[int | None]:
    """The per-request candidate distances of the pruned space, ordered by increasing offload count.

    Offload counts are the paper's D(L) set ``{floor(L/k) : k = 2..L}`` plus 0 ("none") and L ("all");
    each count is realised by its widest distance.
    """
    counts = {num_layers // k for k in range(2, num_layers + 1)} | {0, num_layers}
    return [widest_distance(num_layers, c) for c in sorted(counts)]


@functools.lru_cache(maxsize=64)
def _distance_of_row(num_layers: int) -> dict[bytes, int | None]:
    """The bytes of every distance-driven device row of ``num_layers`` layers (bool), to its distance (None: the row
    that offloads nothing)."""
    rows: dict[bytes, int | None] = {distance_row(num_layers, d).tobytes(): d for d in range(1, num_layers + 1)}
    rows[distance_row(num_layers, None).tobytes()] = None
    return rows


def _unpack_placement(bits: bytes, shape: tuple[int, int]) -> Placement:
    n = shape[0] * shape[1]
    return Placement(np.unpackbits(np.frombuffer(bits, dtype=np.uint8), count=n).reshape(shape).astype(bool))


class Placement:
    """Per-request, per-layer KV placement. ``mask[r, l]`` is True when the KV is on the device."""

    __slots__ = ("_mask",)

    def __init__(self, mask: np.ndarray) -> None:
        m = np.asarray(mask)
        if m.ndim != 2:
            raise ValueError(f"placement mask must be 2-D [requests, layers], got shape {m.shape}")
        if m.shape[1] < 1:
            raise ValueError("placement needs at least one layer")
        self._mask = m.astype(bool, copy=True)
        self._mask.setflags(write=False)

    # -- construction -------------------------------------------------------------------------------
    @classmethod
    def from_mask(cls, mask: np.ndarray | Sequence[Sequence[bool]]) -> Placement:
        """Build from a bool array ``[R, L]`` (True = on device)."""
        return cls(np.asarray(mask, dtype=bool))

    @classmethod
    def from_distances(cls, num_layers: int, distances: Sequence[int | None]) -> Placement:
        """One offload distance per request (``None``: nothing offloaded, ``1``: everything)."""
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        rows = []
        for r, d in enumerate(distances):
            if d is not None and d < 1:
                raise ValueError(f"distances[{r}] must be >= 1 or None, got {d}")
            rows.append(distance_row(num_layers, d))
        mask = np.stack(rows) if rows else np.ones((0, num_layers), dtype=bool)
        return cls(mask)

    def __reduce__(self):
        """Pickled as the mask's bits (a plan crosses the planner process's pipe once per solve)."""
        return _unpack_placement, (np.packbits(self._mask).tobytes(), self._mask.shape)

    # -- views --------------------------------------------------------------------------------------
    @property
    def mask(self) -> np.ndarray:
        """Read-only ``[R, L]`` bool array, True = on device."""
        return self._mask

    @property
    def num_requests(self) -> int:
        return int(self._mask.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self._mask.shape[1])

    @property
    def host(self) -> np.ndarray:
        """``[R, L]`` bool array, True = offloaded to host."""
        return ~self._mask

    def offload_counts(self) -> np.ndarray:
        """Number of host-resident layers per request."""
        return (~self._mask).sum(axis=1)

    def host_layers(self, r: int) -> list[int]:
        """0-based host-resident layers of request ``r``, in order."""
        return [int(i) for i in np.flatnonzero(~self._mask[r])]

    def row_distance(self, r: int) -> int | None:
        """The distance that generates row ``r``; raises ValueError if the row is not distance-driven."""
        row = self._mask[r]
        host = np.flatnonzero(~row)
        if host.size == 0:
            return None
        d = int(host[0]) + 1
        if np.array_equal(row, distance_row(self.num_layers, d)):
            return d
        raise ValueError(f"row {r} is not a distance-driven placement")

    def distances(self) -> list[int | None] | None:
        """Per-request distances, or None when some row is not distance-driven (:meth:`row_distance` of each row, read
        from a table of the distance rows' bytes)."""
        rows = _distance_of_row(self.num_layers)
        out = []
        for row in self._mask:
            d = rows.get(row.tobytes(), 0)
            if d == 0:
                return None
            out.append(d)
        return out

    # -- capacity equation --------------------------------------------------------------------------
    def resident_blocks(self, blocks_per_layer: Sequence[float] | np.ndarray) -> float:
        """``sum_r sum_l b_r x[r, l]``: blocks kept on the device."""
        b = self._check_blocks(blocks_per_layer)
        return float(capacity_terms(~self._mask, b[None, :])[0][0])

    def buffer_blocks(self, blocks_per_layer: Sequence[float] | np.ndarray, slots: int = 1) -> float:
        """Prefetch buffer ``B_buf = max_l sum_r (1 - x[r, l]) b_r min(d, n_r(l))`` for prefetch depth ``d``.

        ``n_r(l)``: host layers of request ``r`` at or after ``l``. While layer ``l``'s KV of ``r`` sits in the
        buffer, ``r``'s next ``d - 1`` host layers may be in flight too; with ``d = 1`` this is the paper's
        ``max_l sum_r (1 - x[r, l]) b_r``.
        """
        b = self._check_blocks(blocks_per_layer)
        return float(capacity_terms(~self._mask, b[None, :], slots)[1][0])

    def memory_blocks(self, blocks_per_layer: Sequence[float] | np.ndarray, slots: int = 1) -> float:
        """Left side of the capacity equation: resident blocks plus prefetch buffer (``slots``: depth)."""
        b = self._check_blocks(blocks_per_layer)
        return float(memory_blocks(~self._mask, b[None, :], slots)[0])

    def host_blocks(self, blocks_per_layer: Sequence[float] | np.ndarray) -> float:
        """Blocks moved over the link in one decode step (``blocks_to_fetch``)."""
        b = self._check_blocks(blocks_per_layer)
        return float(self.offload_counts() @ b)

    def _check_blocks(self, blocks_per_layer: Sequence[float] | np.ndarray) -> np.ndarray:
        b = np.asarray(blocks_per_layer, dtype=float)
        if b.shape != (self.num_requests,):
            raise ValueError(f"blocks_per_layer must have length {self.num_requests}, got shape {b.shape}")
        return b

    # -- misc ---------------------------------------------------------------------------------------
    def key(self) -> bytes:
        """Hashable identity of the mask."""
        return np.packbits(self._mask).tobytes() + bytes(str(self._mask.shape), "ascii")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Placement) and np.array_equal(self._mask, other._mask)

    def __hash__(self) -> int:
        return hash(self.key())

    def __repr__(self) -> str:
        d = self.distances()
        if d is not None:
            return f"Placement(L={self.num_layers}, distances={d})"
        return f"Placement(R={self.num_requests}, L={self.num_layers}, host={int((~self._mask).sum())})"


def buffer_slots(host: np.ndarray, slots: int = 1) -> np.ndarray:
    """Layers of each request the prefetch buffer holds while layer ``l`` is buffered, for a host mask
    ``[R, L]`` (True = offloaded) and prefetch depth ``slots``: ``host[r, l] * min(slots, n_r(l))`` with
    ``n_r(l)`` the host layers of ``r`` at or after ``l``. With one slot it is the host mask itself."""
    if slots == 1:
        return host
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise ValueError(f"slots (prefetch depth) must be an integer >= 1, got {slots!r}")
    remaining = np.cumsum(host[:, ::-1], axis=1)[:, ::-1]
    return np.where(host, np.minimum(remaining, slots), 0)



def capacity_terms(host: np.ndarray, blocks: np.ndarray, slots: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """The capacity equation (paper section 4.3), the one place it is written. For a host mask ``[R, L]`` (True =
    offloaded) and each row of ``blocks`` ``[T, R]`` (blocks per layer of each request at T steps): the resident
    blocks ``sum_r sum_l b_r x[r, l]`` and the prefetch buffer ``max_l sum_r (1 - x[r, l]) b_r min(d, n_r(l))`` at
    depth ``d = slots``. Block counts are integers, so the sums are exact in any order. ``host`` may also be
    0/1 floats (the search's tables)."""
    resident = blocks @ (host.shape[1] - host.sum(axis=1))
    if not host.shape[0]:
        return resident, np.zeros(blocks.shape[0])
    return resident, (blocks @ buffer_slots(host, slots)).max(axis=1)


def memory_blocks(host: np.ndarray, blocks: np.ndarray, slots: int = 1) -> np.ndarray:
    """The capacity equation's left side for each row of ``blocks``: resident blocks plus prefetch buffer
    (:func:`capacity_terms`); it must stay within the device budget."""
    resident, buffer = capacity_terms(host, blocks, slots)
    return resident + buffer


def most_blocks(blocks_per_layer: float, num_layers: int, slots: int = 1) -> float:
    """The most KV blocks any placement can need over both tiers (device and host pools together) for
    requests holding ``blocks_per_layer`` blocks per layer in total: every layer, plus the largest prefetch
    buffer of :func:`capacity_terms` (``slots`` layers of each request). The engine's admission check."""
    return blocks_per_layer * (num_layers + slots)
