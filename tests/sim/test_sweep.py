"""Multi-seed sweeps: confidence intervals, 'better' only without overlap, budgets, link rates, depths."""

import math

import pytest

from orbitflow.plan.hardware import load_preset
from orbitflow.sim.sweep import (
    PAPER_SETUP,
    Point,
    SimSetup,
    better,
    config_record,
    largest_batch_blocks,
    mean_ci95,
    point_device_blocks,
    point_profile,
    summarize,
)


def test_mean_ci95_uses_student_t():
    cell = mean_ci95([1.0, 2.0, 3.0, 4.0, 5.0])
    assert cell["mean"] == 3.0 and cell["n"] == 5
    assert cell["ci95"] == pytest.approx(2.776 * math.sqrt(2.5) / math.sqrt(5))
    assert mean_ci95([7.0]) == {"mean": 7.0, "ci95": 0.0, "n": 1}
    assert mean_ci95([None, float("nan")])["mean"] is None


def test_better_only_without_overlap():
    hi, lo = {"mean": 0.9, "ci95": 0.05, "n": 5}, {"mean": 0.7, "ci95": 0.1, "n": 5}
    assert better(hi, lo, "tbt_attainment") and not better(lo, hi, "tbt_attainment")
    assert not better({"mean": 0.9, "ci95": 0.15, "n": 5}, lo, "tbt_attainment")  # 0.75 < 0.8: overlap
    assert better(lo, hi, "p95_tbt_s") and not better(hi, lo, "p95_tbt_s")  # lower is better for latency


def test_no_win_from_or_against_a_single_value():
    """One seed left (the others NaN) reads as an interval of half-width 0: it was enough to claim a win."""
    one, many = mean_ci95([0.9]), mean_ci95([0.8, 0.81, 0.79, 0.8, 0.8])
    assert one["n"] == 1 and not better(one, many, "tbt_attainment") and not better(many, one, "tbt_attainment")
    assert not better(mean_ci95([0.9]), mean_ci95([0.8, float("nan"), float("nan")]), "tbt_attainment")
    assert better(mean_ci95([0.9, 0.91]), many, "tbt_attainment")


def test_summary_groups_seeds_per_point():
    runs = [{"label": "x", "policy": "x", "slo_scale": 1.0, "rate_scale": 1.0, "token_deposit": True, "seed": s,
             "tbt_attainment": v} for s, v in enumerate([0.5, 0.7])]
    (row,) = summarize(runs, metrics=("tbt_attainment",))
    assert row["seeds"] == [0, 1] and row["tbt_attainment"]["mean"] == pytest.approx(0.6)


def test_no_win_from_or_against_a_mean_that_left_seeds_out():
    """A seed that served nothing has no TBT attainment: the mean of the other seeds is not the point's, so it was
    averaged as if it were (a policy that refused a seed's requests read 1.0 against one that served them)."""
    runs = [{"label": "x", "policy": "x", "slo_scale": 1.0, "rate_scale": 1.0, "token_deposit": True, "seed": s,
             "tbt_attainment": v} for s, v in enumerate([1.0, 1.0, 1.0, float("nan")])]
    (row,) = summarize(runs, metrics=("tbt_attainment",))
    cell = row["tbt_attainment"]
    assert cell["n"] == 3 and cell["missing"] == 1
    low = mean_ci95([0.6, 0.61, 0.59, 0.6]) | {"missing": 0}
    assert not better(cell, low, "tbt_attainment") and not better(low, cell, "p95_tbt_s")
    assert better(cell | {"missing": 0}, low, "tbt_attainment")


def test_paper_setup_and_point_overrides():
    prof = load_preset("a5000-llama3-8b")
    assert PAPER_SETUP.device_kv_fraction == 0.5 and PAPER_SETUP.seeds >= 5 and PAPER_SETUP.num_requests >= 64
    assert PAPER_SETUP.noise_cv > 0 and PAPER_SETUP.solver_time == "measured"
    largest = largest_batch_blocks(prof, 32768)
    assert largest == 32768 // 16 * 32
    assert point_device_blocks(prof, PAPER_SETUP, Point("orbitflow", 1, 1)) == largest // 2
    assert point_device_blocks(prof, PAPER_SETUP, Point("orbitflow", 1, 1, device_kv_fraction=0.23)) == \
        round(0.23 * largest)
    assert point_profile(prof, PAPER_SETUP, Point("orbitflow", 1, 1, link_gbps=12.0)).link_bytes_per_s == 12e9
    cfg = config_record(prof, PAPER_SETUP, [Point("orbitflow", 1, 1), Point("deepspeed", 1, 1, prefetch_slots=2)])
    assert cfg["device_kv_blocks"] == largest // 2 and cfg["seeds"] == [0, 1, 2, 3, 4]
    assert cfg["link_gbps"] == pytest.approx(prof.link_bytes_per_s / 1e9)


@pytest.mark.parametrize("kwargs, flag", [({"seeds": 0}, "--seeds"), ({"noise_cv": -1}, "--noise-cv"),
                                          ({"device_kv_fraction": 0}, "--device-kv-fraction"),
                                          ({"solver_time": "soon"}, "--solver-time")])
def test_setup_names_the_bad_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        SimSetup(**kwargs)


@pytest.mark.parametrize("fraction", [-0.5, 0.0, 20.0, float("nan")])
def test_a_points_device_fraction_is_checked_as_the_setups(fraction):
    """A point's own fraction bypassed SimSetup's range: -0.5 ran with a one-block budget and rejected everything."""
    with pytest.raises(ValueError, match="device_kv_fraction must be in"):
        Point("flexgen", 1.0, 1.0, device_kv_fraction=fraction)


def test_run_points_starts_the_first_group_first_and_slow_policies_first_within_each(monkeypatch):
    """An interrupted sweep has the runs of ``first`` (make_results' reduced page needs them); inside each group the
    slow policies start first so a pool drains evenly. The results come back in point then seed order regardless."""
    from orbitflow.sim import sweep

    ran = []
    monkeypatch.setattr(sweep, "run_one", lambda profile, setup, point, seed: ran.append((point.policy, seed))
                        or {"policy": point.policy, "seed": seed})
    setup = sweep.SimSetup(seeds=2)
    pts = [sweep.Point(name, 1.0, 1.0) for name in ("flexgen", "orbitflow", "deepspeed", "dynamic")]
    out = sweep.run_points(load_preset("a5000-llama3-8b"), setup, pts, workers=1, first=[pts[0], pts[2]],
                           done={(pts[1], 1): {"policy": "orbitflow", "seed": 1}})
    assert ran == [("flexgen", 0), ("flexgen", 1), ("deepspeed", 0), ("deepspeed", 1), ("orbitflow", 0),
                   ("dynamic", 0), ("dynamic", 1)]  # orbitflow seed 1 was done already
    assert [(r["policy"], r["seed"]) for r in out] == [(p.policy, s) for p in pts for s in (0, 1)]
