import subprocess
import sys

import numpy as np
import pytest

from orbitflow.plan import Placement, pruned_distances, widest_distance


def test_from_distances_rows():
    p = Placement.from_distances(9, [None, 3, 1, 4])
    host = p.host
    assert not host[0].any()
    assert p.host_layers(1) == [2, 5, 8]  # 1-based layers 3, 6, 9
    assert host[2].all()
    assert p.host_layers(3) == [3, 7]
    assert p.distances() == [None, 3, 1, 4]
    assert list(p.offload_counts()) == [0, 3, 9, 2]


def test_from_mask_roundtrip_and_custom_rows():
    mask = np.ones((2, 5), bool)
    mask[1, [0, 3]] = False
    p = Placement.from_mask(mask)
    assert np.array_equal(p.mask, mask)
    assert p.distances() is None  # row 1 offloads layers 1 and 4: not distance-driven
    assert p.row_distance(0) is None
    with pytest.raises(ValueError, match="row 1 is not a distance-driven placement"):
        p.row_distance(1)
    with pytest.raises(ValueError):
        p.mask[0, 0] = False  # read-only


def test_capacity_equation_paper_example():
    b1, b16 = [3, 6], [4, 6]
    a = Placement.from_distances(9, [3, 3])
    b = Placement.from_distances(9, [None, 3])
    c = Placement.from_distances(9, [4, 3])
    assert (a.memory_blocks(b1), a.memory_blocks(b16)) == (63, 70)
    assert (b.memory_blocks(b1), b.memory_blocks(b16)) == (69, 78)
    assert (c.memory_blocks(b1), c.memory_blocks(b16)) == (63, 70)


def test_memory_blocks_matches_definition_random():
    rng = np.random.default_rng(0)
    for _ in range(50):
        mask = rng.random((4, 7)) < 0.6
        b = rng.integers(1, 50, 4)
        p = Placement.from_mask(mask)
        resident = sum(b[r] * mask[r, l] for r in range(4) for l in range(7))
        buf = max(sum(b[r] * (not mask[r, l]) for r in range(4)) for l in range(7))
        assert p.memory_blocks(b) == resident + buf
        assert p.host_blocks(b) == sum(b[r] * (not mask[r, l]) for r in range(4) for l in range(7))


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"distances\[0\] must be >= 1 or None, got 0"):
        Placement.from_distances(4, [0])
    with pytest.raises(ValueError, match="placement mask must be 2-D"):
        Placement.from_mask(np.ones(3, bool))
    with pytest.raises(ValueError, match="blocks_per_layer must have length 1"):
        Placement.from_distances(4, [2]).memory_blocks([1, 2])


@pytest.mark.parametrize("n_layers", [1, 2, 9, 16, 32, 80])
def test_pruned_distances_cover_paper_set(n_layers):
    dists = pruned_distances(n_layers)
    counts = [int((~Placement.from_distances(n_layers, [d]).mask).sum()) for d in dists]
    expected = {n_layers // k for k in range(2, n_layers + 1)} | {0, n_layers}
    assert counts == sorted(expected)
    for d, c in zip(dists, counts):
        if d is not None:  # widest distance realising the count
            assert n_layers // d == c and (d + 1 > n_layers or n_layers // (d + 1) != c)
    assert widest_distance(n_layers, 0) is None
    if n_layers == 32:
        assert len(dists) - 2 + (1 if 1 in {n_layers // k for k in range(2, 33)} else 0) >= 9


def test_import_does_not_pull_torch():
    code = "import sys, orbitflow.plan; assert 'torch' not in sys.modules, 'torch imported'"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_buffer_grows_with_prefetch_depth():
    # distance 2 over 4 layers: host layers 1 and 3 of both requests
    p = Placement.from_distances(4, [2, 2])
    b = [3, 5]
    assert p.buffer_blocks(b) == 8  # the paper's max_l sum_r (1 - x) b_r
    assert p.buffer_blocks(b, slots=1) == 8
    assert p.buffer_blocks(b, slots=2) == 16  # layer 1 buffered while layer 3 may be in flight
    assert p.buffer_blocks(b, slots=3) == 16  # only two host layers each
    assert p.memory_blocks(b, slots=2) == p.resident_blocks(b) + 16
    one = Placement.from_distances(4, [4, None])  # a single host layer: depth cannot add to it
    assert one.buffer_blocks(b, slots=2) == one.buffer_blocks(b) == 3


def test_most_blocks_bounds_both_tiers_and_is_reached_fully_offloaded():
    from orbitflow.plan.placement import most_blocks

    rng = np.random.default_rng(3)
    for _ in range(50):
        n_req, n_layers, slots = int(rng.integers(1, 5)), int(rng.integers(2, 9)), int(rng.integers(1, 3))
        b = rng.integers(1, 30, n_req)
        for mask in (rng.random((n_req, n_layers)) < 0.5, np.zeros((n_req, n_layers), bool)):
            p = Placement.from_mask(mask)
            both_tiers = p.memory_blocks(b, slots) + p.host_blocks(b)
            assert both_tiers <= most_blocks(int(b.sum()), n_layers, slots)
        assert both_tiers == most_blocks(int(b.sum()), n_layers, slots)  # everything on the host


@pytest.mark.parametrize("shape", [(0, 5), (1, 1), (3, 7), (4, 32), (16, 80)])
def test_pickles_as_its_bits(shape):
    """A plan crosses the planner process's pipe pickled: the mask comes back exact, read-only, same shape."""
    import pickle

    mask = np.random.default_rng(shape[0] * 100 + shape[1]).random(shape) < 0.5
    back = pickle.loads(pickle.dumps(Placement(mask)))
    assert back.mask.shape == shape and back.mask.dtype == bool and np.array_equal(back.mask, mask)
    assert not back.mask.flags.writeable
    assert len(pickle.dumps(Placement(mask))) < len(pickle.dumps(mask)) + 64


def test_distances_read_from_the_table_agree_with_each_rows_distance():
    """Placement.distances looks each row up among the distance rows' bytes: the same answer as row_distance on every
    row, and None as soon as one row is not distance-driven."""
    rng = np.random.default_rng(3)
    for n_layers in (1, 2, 7, 32):
        for _ in range(50):
            ds = [None if rng.random() < 0.2 else int(rng.integers(1, n_layers + 3)) for _ in range(4)]
            p = Placement.from_distances(n_layers, ds)
            assert p.distances() == [p.row_distance(r) for r in range(4)]
            mask = p.mask.copy()
            mask[int(rng.integers(4)), int(rng.integers(n_layers))] ^= True
            q = Placement(mask)
            try:
                want = [q.row_distance(r) for r in range(4)]
            except ValueError:
                want = None
            assert q.distances() == want
