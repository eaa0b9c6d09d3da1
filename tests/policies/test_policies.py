"""Every policy answers through the same interface; the baselines behave as the paper describes them."""

import numpy as np
import pytest

from orbitflow.plan import CostModel, PlanRequest
from orbitflow.policies import ABLATIONS, POLICIES, make_policy
from orbitflow.policies.base import PlanContext, evenly_spaced_row

L = 8


def ctx(capacity=400, link=40.0, **kw):
    return PlanContext(num_layers=L, block_size=16, capacity_blocks=capacity,
                       cost_model=CostModel([0.01] * L, link), window=(1, 8), **kw)


def reqs(blocks, slo=0.2, deposit=0.0):
    return [PlanRequest(f"r{i}", b, b * 16, 32, deposit, slo) for i, b in enumerate(blocks)]


def test_the_context_hands_its_seed_to_the_planner():
    """--seed reaches the random victim rule (the context once built every planner with seed 0)."""
    batch = reqs([10, 20, 5, 7, 9])
    orders = {ctx(victim="random", seed=s).planner().plan(batch).victims for s in range(8)}
    assert len(orders) > 1


@pytest.mark.parametrize("name", list(POLICIES) + list(ABLATIONS))
def test_every_policy_returns_a_plan_for_the_batch(name):
    plan = make_policy(name).plan(reqs([10, 20, 5]), ctx())
    assert plan.placement is not None and plan.placement.mask.shape == (3, L)
    assert plan.feasible


def test_deepspeed_keeps_everything_on_the_host():
    plan = make_policy("deepspeed").plan(reqs([10, 20]), ctx())
    assert not plan.placement.mask.any()


@pytest.mark.parametrize("name", ["fixed:all", "deepspeed"])
def test_a_kept_placement_the_host_pool_cannot_hold_to_the_end_is_infeasible(name):
    """Every layer on the host: r0 and r1 end at 3 and 4 blocks per layer (48 and 64 tokens), 8 layers: 56 host
    blocks in all. Below that the plan is infeasible (admission keeps the newest waiting) though the first steps fit; a
    request that alone needs more than the whole pool is one the policy cannot serve."""
    policy = make_policy(name)
    assert policy.plan(reqs([1, 2]), ctx(host_capacity_blocks=56)).feasible
    short = policy.plan(reqs([1, 2]), ctx(host_capacity_blocks=55))
    assert not short.feasible and short.placement is None and short.victims == ("r1",)
    assert policy.unservable(reqs([2])[0], ctx(host_capacity_blocks=32)) is None
    assert "needs 32 host KV blocks, and the host pool has 31" in policy.unservable(reqs([2])[0],
                                                                                   ctx(host_capacity_blocks=31))


def test_a_fixed_placement_the_device_budget_cannot_hold_is_infeasible_not_an_error():
    policy = make_policy("fixed:none")  # r0, r1 end at 3 and 4 blocks per layer: 56 device blocks
    assert policy.plan(reqs([1, 2]), ctx(capacity=56)).feasible
    assert not policy.plan(reqs([1, 2]), ctx(capacity=55)).feasible
    assert "needs 32 device KV blocks (resident + prefetch buffer), and --device-kv-blocks is 31" in \
        policy.unservable(reqs([2])[0], ctx(capacity=31))
    assert make_policy("orbitflow").unservable(reqs([2])[0], ctx(capacity=23)) is None  # it can offload


def test_evenly_spaced_rows_match_distances():
    assert evenly_spaced_row(8, 4).tolist() == [True, False] * 4  # every 2nd layer, as distance 2
    assert (~evenly_spaced_row(8, 3)).sum() == 3
    assert evenly_spaced_row(8, 0).all() and not evenly_spaced_row(8, 8).any()


def test_flexgen_fixes_one_count_offline_for_the_worst_case():
    policy = make_policy("flexgen")
    c = ctx(capacity=300, max_num_seqs=2, max_batch_tokens=2 * 16 * 20)  # worst case: 2 x 20 blocks/layer
    small = policy.plan(reqs([2, 3]), c)
    large = policy.plan(reqs([15, 18]), c)
    rows = np.vstack([small.placement.mask, large.placement.mask])
    assert (rows == rows[0]).all()  # the same layers for every request, whatever the batch
    assert (~rows[0]).sum() > 0  # the worst case does not fit on device, so it offloads even tiny batches


def test_flexgen_plus_rechooses_for_the_current_batch():
    policy = make_policy("flexgen+")
    small = policy.plan(reqs([2, 3]), ctx(capacity=200))
    large = policy.plan(reqs([15, 18]), ctx(capacity=200))
    assert small.placement.mask.all()  # fits: nothing offloaded
    assert not large.placement.mask.all() and large.feasible
    assert (large.placement.mask == large.placement.mask[0]).all()  # still uniform


def test_dynamic_offloads_the_fewest_layers_that_fit_largest_first():
    plan = make_policy("dynamic").plan(reqs([4, 30]), ctx(capacity=250))
    host = (~plan.placement.mask).sum(axis=1)
    assert plan.feasible and host[1] > 0 and host[0] == 0


def test_slo_aware_offloads_as_much_as_the_slo_allows():
    loose = make_policy("slo-aware").plan(reqs([10, 10], slo=10.0), ctx(capacity=1000))
    tight = make_policy("slo-aware").plan(reqs([10, 10], slo=0.081), ctx(capacity=1000))
    assert (~loose.placement.mask).sum() > (~tight.placement.mask).sum()


def test_slo_aware_keeps_the_slo_until_the_batch_changes():
    """Select-N's count holds until the batch changes, so it must meet the SLO at the batch's last step, not only
    now: two requests 200 tokens from their end (10 -> 23 blocks per layer). Offloading 3 layers meets the SLO now
    (90 ms) and misses it 199 steps on (168 ms); the policy offloads 1. A batch about to change offloads 3."""
    from orbitflow.plan import Placement

    c = ctx(capacity=1000, link=1000.0)

    def step_s(count: int, blocks: int, tokens: int) -> float:  # the cost model's step, `count` layers offloaded
        mask = np.tile(evenly_spaced_row(L, count), (2, 1))
        return c.cost_model.step(Placement.from_mask(mask), [blocks] * 2, total_tokens=2 * tokens).total_s

    # now (160 tokens, 10 blocks) and at the last step before the batch changes (359 tokens, 23 blocks)
    assert step_s(3, 10, 160) <= 0.1 < step_s(3, 23, 359)
    assert step_s(1, 23, 359) <= 0.1 < step_s(2, 23, 359)
    growing = [PlanRequest(f"r{i}", 10, 160, 200, 0.0, 0.1) for i in range(2)]
    plan = make_policy("slo-aware").plan(growing, c)
    assert (~plan.placement.mask).sum(axis=1).tolist() == [1, 1]
    ending = [PlanRequest(f"r{i}", 10, 160, 1, 0.0, 0.1) for i in range(2)]
    assert (~make_policy("slo-aware").plan(ending, c).placement.mask).sum(axis=1).tolist() == [3, 3]


def test_deposit_balance_reaches_the_planner_and_changes_the_plan():
    """Without a balance no plan meets the SLO cap (so OrbitFlow would pause someone); with a balance
    the deposit covers the slow steps and the whole batch runs."""
    c = ctx(capacity=150, link=300.0, alpha=0.0)
    without = make_policy("orbitflow").plan(reqs([12, 12], slo=0.085), c)
    with_balance = make_policy("orbitflow").plan(reqs([12, 12], slo=0.085, deposit=5.0), c)
    assert not without.feasible and without.victims
    assert with_balance.feasible


def test_token_deposit_off_reaches_the_planner():
    """--no-token-deposit reaches the planner the policy builds (it once planned as if steps banked margin)."""
    from orbitflow.config import EngineConfig
    from orbitflow.plan.hardware import HardwareProfile

    profile = HardwareProfile(name="p", num_layers=L, kv_bytes_per_token_per_layer=256, decode_a=2e-6, decode_b=0.012,
                              link_bytes_per_s=2e6, device_kv_blocks=40, host_kv_blocks=4000, block_size=16)
    for flag in (True, False):
        config = EngineConfig.build(model="p", token_deposit=flag, device_kv_blocks=40, block_size=16)
        assert PlanContext.from_profile(config, profile).planner().constraints.token_deposit is flag


def test_unknown_policy_names_the_flag():
    from orbitflow.config import ConfigError

    with pytest.raises(ConfigError, match="--policy"):
        make_policy("nope")


@pytest.mark.parametrize("name", ["flexgen", "flexgen+"])
def test_flexgen_prefetches_at_its_code_s_depth_two(name):
    """FlexGen's overlapped loop loads layer j+1's cache while layer j computes: depth 2, as DeepSpeed; a config's
    --prefetch-slots still overrides it."""
    from orbitflow.config import EngineConfig
    from orbitflow.policies.base import prefetch_slots_for

    assert prefetch_slots_for(EngineConfig(), make_policy(name)) == 2
    assert prefetch_slots_for(EngineConfig.build(prefetch_slots=1), make_policy(name)) == 1


def test_deepspeed_prefetches_one_layer_ahead_at_depth_two():
    """Paper 5.1, Baselines 1: DeepSpeed fetches layer i+1 while layer i runs. One request, four layers on the
    host, 1 s per transfer and per layer: 5 s with the overlap (depth 2) instead of 8 s."""
    from orbitflow.config import EngineConfig
    from orbitflow.policies.base import prefetch_slots_for

    ds = make_policy("deepspeed")
    assert prefetch_slots_for(EngineConfig(), ds) == 2
    assert prefetch_slots_for(EngineConfig(), make_policy("orbitflow")) == 1
    assert prefetch_slots_for(EngineConfig.build(prefetch_slots=1), ds) == 1  # the config overrides the policy
    reqs = [PlanRequest("a", 2, 32, 0)]
    for slots, step_s in ((2, 5.0), (1, 8.0)):
        ctx = PlanContext(num_layers=4, block_size=16, capacity_blocks=100,
                          cost_model=CostModel([1.0] * 4, 2.0, prefetch_slots=slots))
        assert ds.plan(reqs, ctx).predicted_step_s == pytest.approx(step_s)


def test_dynamic_cache_hit_returns_the_plan_of_the_key_it_matched():
    """A replica's what-if asks the engine's policy from the router's thread: a `_last` replaced between the key
    check and the read must not hand the engine another batch's plan (here the swap happens inside the key
    comparison itself, standing in for the other thread)."""
    policy = make_policy("dynamic")
    other = policy.plan(reqs([3]), ctx())  # a one-request batch, as a what-if's would be

    class SwapOnCompare(str):
        armed = False

        def __eq__(self, o):
            if SwapOnCompare.armed:
                SwapOnCompare.armed = False
                policy._last = ("what-if", other)
            return str.__eq__(self, o)

        __hash__ = str.__hash__

    def batch():  # equal ids, new objects (an identical object would skip __eq__)
        return [PlanRequest(SwapOnCompare(f"r{i}"), b, b * 16, 32, 0.0, 0.2) for i, b in enumerate([10, 20])]

    engine_ctx = ctx()  # the engine's context: its cost model stays one object until a refresh
    first = policy.plan(batch(), engine_ctx)
    SwapOnCompare.armed = True
    again = policy.plan(batch(), engine_ctx)
    assert again is first and again.placement.mask.shape == (2, L)


@pytest.mark.parametrize("name", list(POLICIES) + list(ABLATIONS))
def test_every_policy_plans_an_empty_batch(name):
    """A library caller may ask for an empty batch; SLO-aware raised (min() of no SLOs)."""
    plan = make_policy(name).plan([], ctx())
    assert plan.feasible and plan.request_ids == ()


def test_dynamics_reused_decision_follows_the_host_pool_and_the_cost_model():
    """Dynamic reuses its decision while no block count changes; its feasibility reads the host KV left to the batch
    and its predicted step the cost model (refreshed from measurements), so either changing is a new decision."""
    from dataclasses import replace

    policy, batch = make_policy("dynamic"), reqs([30, 30, 30])
    engine_ctx = ctx(capacity=500, link=4000.0)  # its cost model stays one object until a refresh
    first = policy.plan(batch, engine_ctx)  # it offloads some layers
    assert first.feasible and first.distances == (1, 4, None)
    assert policy.plan(batch, engine_ctx) is first  # reused
    no_host = policy.plan(batch, replace(engine_ctx, host_capacity_blocks=0))
    assert not no_host.feasible  # with no host KV left its offload cannot run (the reused decision said feasible)
    refreshed = engine_ctx.cost_model.with_updates(layer_compute_scale=10.0)
    assert policy.plan(batch, replace(engine_ctx, cost_model=refreshed)).predicted_step_s > first.predicted_step_s


def test_the_plan_gap_reaches_the_planner():
    """--plan-gap is the planner's relative gap (a MIP solver's MIPGap), carried by the context to every solve."""
    from orbitflow.config import EngineConfig
    from orbitflow.plan.hardware import HardwareProfile

    profile = HardwareProfile(name="p", num_layers=L, kv_bytes_per_token_per_layer=256, decode_a=2e-6, decode_b=0.012,
                              link_bytes_per_s=2e6, device_kv_blocks=40, host_kv_blocks=4000, block_size=16)
    for gap in (0.0, 1e-4, 0.05):
        config = EngineConfig.build(model="p", plan_gap=gap, device_kv_blocks=40, block_size=16)
        ctx = PlanContext.from_profile(config, profile)
        assert ctx.gap == gap and ctx.planner().gap == gap
