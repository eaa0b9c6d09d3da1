"""plan/horizon.py: the horizon an expiry check searches, built from the last one's arrays (Horizon.after), is the one
the batch's requests would build t steps later, and the balances it carries (NumPy and compiled) are each request's
own."""

import math

import numpy as np
import pytest

from orbitflow.plan import CostModel, PlanRequest
from orbitflow.plan import compiled as cc
from orbitflow.plan import deposit as dep
from orbitflow.plan.horizon import Horizon


def _batch(rng, n_req):
    return [PlanRequest(i, int(rng.integers(1, 40)), int(rng.integers(0, 600)),
                        None if rng.random() < 0.3 else int(rng.integers(0, 12)), float(rng.uniform(-1, 8)),
                        float(rng.uniform(0.01, 0.05)) if rng.random() < 0.8 else math.inf)
            for i in range(n_req)]


def _same(a: Horizon, b: Horizon) -> None:
    assert np.array_equal(a.blocks, b.blocks) and np.array_equal(a.total_tokens, b.total_tokens)
    assert a.boundaries == b.boundaries and a.seg_starts == b.seg_starts and a.seg_ends == b.seg_ends
    assert np.array_equal(a.seg_starts_a, b.seg_starts_a) and np.array_equal(a.seg_ends_a, b.seg_ends_a)
    assert len(a.comp) == len(b.comp) and all(np.array_equal(x, y) for x, y in zip(a.comp, b.comp))
    assert a.compute_grows == b.compute_grows and a.horizon == b.horizon and a.bank_max == b.bank_max
    assert np.array_equal(a.slo, b.slo) and np.array_equal(a.deposit, b.deposit)
    for x, y in zip(a.rows(), b.rows()):
        assert np.array_equal(x, y)


@pytest.mark.parametrize("token_compute", [False, True])
@pytest.mark.parametrize("bank_max", [math.inf, 0.0, 3.0])
def test_after_is_the_horizon_of_the_requests_t_steps_later(token_compute, bank_max):
    rng = np.random.default_rng(7 + token_compute)
    comp = rng.uniform(1e-3, 2e-3, 6)
    cm = (CostModel(lambda tok: comp * (1 + tok / 3e3), 400.0, num_layers=6) if token_compute
          else CostModel(comp, 400.0, transfer_latency_s=1e-4))
    for _ in range(60):
        reqs = _batch(rng, int(rng.integers(1, 6)))
        steps, block = int(rng.integers(1, 17)), int(rng.choice([1, 4, 16]))
        win = Horizon(reqs, steps, block, cm, bank_max)
        seg_lat = rng.uniform(0.005, 0.08, len(win.seg_starts)).tolist()
        for t in range(0, steps + 3):
            balances = dep.balances_after(win.deposit, win.slo, seg_lat, win.seg_starts, win.seg_ends, t, bank_max)
            one_by_one = [dep.balance_after(q.deposit, q.slo_s, seg_lat, win.seg_starts, win.seg_ends, t, bank_max)
                          for q in reqs]
            assert balances.tolist() == one_by_one  # the same floats, not just close
            kernel = cc.balances_after(win.deposit, win.slo, np.array(seg_lat), win.seg_starts_a, win.seg_ends_a, t,
                                       bank_max)
            assert kernel.tolist() == one_by_one
            later = Horizon([q.after(t, b) for q, b in zip(reqs, one_by_one)], steps, block, cm, bank_max)
            _same(win.after(t, balances), later)
            _same(win.after(t, balances).after(1, later.deposit), Horizon(
                [q.after(t, b).after(1, b) for q, b in zip(reqs, one_by_one)], steps, block, cm, bank_max))


def test_rows_of_same_and_token_dependent_compute_are_each_segments_own():
    """Horizon.rows: per segment its compute, suffix sums, total and transfer seconds, whether the segments share one
    compute (then one table serves every horizon of that many segments) or each has its own."""
    rng = np.random.default_rng(11)
    comp = rng.uniform(1e-3, 2e-3, 5)
    for cm in (CostModel(comp, 300.0, transfer_latency_s=2e-4), CostModel(lambda tok: comp * (1 + tok / 1e3), 300.0,
                                                                          num_layers=5)):
        for _ in range(20):
            win = Horizon(_batch(rng, 3), int(rng.integers(1, 17)), 4, cm)
            seg_comp, tails, sums, xfer = win.rows()
            assert seg_comp.shape == (len(win.seg_starts), 5) and seg_comp.flags.writeable
            for i, c in enumerate(win.comp):
                assert np.array_equal(seg_comp[i], c) and np.array_equal(tails[i], np.cumsum(c[::-1])[::-1])
                assert sums[i] == float(np.asarray(c).sum())
                assert np.array_equal(xfer[i], cm.transfer_s(win.blocks[win.seg_starts[i]]))


def test_compiled_horizon_blocks_are_the_numpy_ones():
    """compiled.horizon_blocks against the NumPy horizon_blocks, exactly: finished and unbounded requests, blocks that
    only grow past their current count, block sizes of 1 and counts near the planner's int64 limit."""
    from orbitflow.plan.horizon import UNBOUNDED, horizon_blocks

    rng = np.random.default_rng(13)
    for _ in range(300):
        n_req, steps, block = int(rng.integers(1, 7)), int(rng.integers(1, 20)), int(rng.choice([1, 3, 16]))
        big = rng.random() < 0.2
        tok = rng.integers(0, 2**60 if big else 500, n_req).astype(np.int64)
        b_now = np.maximum(tok // block + rng.integers(-2, 3, n_req), 0).astype(np.int64)
        left = np.where(rng.random(n_req) < 0.3, UNBOUNDED, rng.integers(0, 25, n_req)).astype(np.int64)
        want = horizon_blocks(b_now, tok, left, steps, block)
        got = cc.horizon_blocks(b_now, tok, left, steps, block)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and np.array_equal(a, b)


@pytest.mark.skipif(not cc.HAVE_NUMBA, reason="the compiled schedule")
@pytest.mark.parametrize("transfer", ["edf", "preemptive"])
def test_segment_latencies_in_one_call_are_the_cost_models(transfer):
    """Constraints.seg_latencies schedules every missing segment in one compiled call (compiled.segments_added, its
    scratch shared by the segments): each latency is the reference cost model's, with token-dependent compute (a
    different compute per segment), a host-layer cost and segments asked in pieces, out of order and again."""
    from orbitflow.plan import Planner

    rng = np.random.default_rng(12)
    comp = rng.uniform(1e-3, 2e-3, 8)
    for _ in range(30):
        cm = CostModel(lambda tok: comp * (1 + tok / 2e3), float(rng.uniform(50, 400)), transfer, num_layers=8,
                       host_layer_s=float(rng.choice([0.0, 1e-4])))
        reqs = _batch(rng, int(rng.integers(1, 5)))
        rules = Planner(cm, 1e9, window=(1, 16), compiled=True).constraints
        win, host = rules.horizon(reqs), rng.random((len(reqs), 8)) < 0.4
        n = len(win.seg_starts)
        split = int(rng.integers(0, n + 1))
        got = rules.seg_latencies(win, host, upto=n, first=split) + rules.seg_latencies(win, host, upto=split)
        got = got[n - split:] + got[: n - split]  # segments 0..n-1
        assert rules.seg_latencies(win, host) == got  # memoised: asked again, the same
        want = [float(win.comp[i].sum()) + cm.added_s(host, win.blocks[win.seg_starts[i]], win.comp[i])
                for i in range(n)]
        assert got == want
