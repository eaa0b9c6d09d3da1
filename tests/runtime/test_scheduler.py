"""The scheduler alone: no model, no executor. A scripted policy decides feasibility; the test plays the
executor's part with hand-made StepResults and checks queues, Pause-Resume and the outputs."""

from __future__ import annotations

import dataclasses

import pytest
from scripted_policies import CapPolicy, CrowdedPolicy, PausesAForB

from orbitflow.config import EngineConfig
from orbitflow.kv.manager import KVManager
from orbitflow.plan import CostModel
from orbitflow.policies.base import PlanContext, Policy
from orbitflow.runtime.clock import VirtualClock
from orbitflow.runtime.controller import Controller
from orbitflow.runtime.deposit import TokenDeposit
from orbitflow.runtime.outputs import StepResult
from orbitflow.runtime.request import Request, Status
from orbitflow.runtime.sampling import SamplingParams
from orbitflow.runtime.scheduler import MAX_IDLE_PAUSES, NO_FIT, Scheduler

LAYERS, BS = 4, 16


def make_scheduler(policy: Policy, device_blocks: int = 64, host_blocks: int = 64, **config):
    cfg = EngineConfig.build(model="tiny", block_size=BS, device_kv_blocks=device_blocks, max_num_seqs=4, **config)
    ctx = PlanContext(num_layers=LAYERS, block_size=BS, capacity_blocks=device_blocks,
                      cost_model=CostModel([1e-3] * LAYERS, 1e4))
    kv = KVManager(LAYERS, 1, 1, device_blocks, host_blocks, block_size=BS, materialize=False)
    clock = VirtualClock()
    return Scheduler(cfg, kv, Controller(policy, ctx, background=False), LAYERS, clock.now)


def add(sched: Scheduler, rid: str, prompt: int = 20, max_tokens: int = 4, arrival: float = 0.0) -> Request:
    req = Request(rid, list(range(1, prompt + 1)), SamplingParams(max_tokens=max_tokens), arrival, 1.0,
                  TokenDeposit(1.0))
    sched.add_request(req)
    return req


def run(sched: Scheduler, out, token: int = 7) -> None:
    """Play the executor and the engine's output processing for one step."""
    result = StepResult(tokens=[token if s.sample else None for s in out.seqs], step_s=0.01,
                        layer_compute_s=[0.0025] * LAYERS, layer_stall_s=[0.0] * LAYERS)
    sched.update_from_output(out, result)
    for seq in out.seqs:
        if seq.sample:
            sched.requests[seq.req_id].output_ids.append(token)
    sched.finish_step()


def ids(reqs):
    return [r.request_id for r in reqs]


def test_admits_in_order_and_the_newest_waits_when_it_would_be_the_victim():
    sched = make_scheduler(CapPolicy(cap=2))
    for rid in "abc":
        add(sched, rid)
    out = sched.schedule()
    assert [s.req_id for s in out.seqs] == ["a", "b"] and not out.is_decode  # a prefill step
    assert set(out.placement) == {"a", "b"} and all(all(row) for row in out.placement.values())
    assert ids(sched.running) == ["a", "b"] and ids(sched.waiting) == ["c"] and not out.paused_ids
    assert out.num_prefill_tokens == 40 and out.plan is sched.controller.plan
    run(sched, out)
    out = sched.schedule()
    assert out.is_decode and [s.start_pos for s in out.seqs] == [20, 20] and out.placement == {}


def test_pauses_the_policys_victim_and_resumes_it_only_after_a_completion():
    sched = make_scheduler(CapPolicy(cap=2, victim="a"))
    a = add(sched, "a")
    add(sched, "b", max_tokens=2)
    run(sched, sched.schedule())
    add(sched, "c")
    out = sched.schedule()  # admitting c makes the batch infeasible: the policy names a
    assert out.paused_ids == ["a"] and a.status is Status.PAUSED and a.num_pauses == 1
    assert ids(sched.running) == ["b", "c"] and "a" in sched.kv.tables  # a paused request keeps its KV
    assert [s.req_id for s in out.seqs] == ["c"]  # the new prompt prefills; decoding waits
    run(sched, out)
    out = sched.schedule()
    assert not out.resumed_ids and ids(sched.paused) == ["a"]  # the gate: nobody has completed yet
    run(sched, out)
    sched.finish_requests(["b"], "length")
    assert [r.request_id for r in sched.take_finished()] == ["b"] and "b" not in sched.kv.tables
    out = sched.schedule()
    assert out.resumed_ids == ["a"] and a.status is Status.RUNNING and ids(sched.running) == ["c", "a"]
    assert {s.req_id for s in out.seqs} == {"a", "c"} and out.is_decode


def test_the_end_of_a_request_that_never_ran_does_not_open_the_resume_gate():
    """The gate waits for a request that held KV to end (memory freed); aborting one still waiting frees nothing, and
    resuming then is the thrash the gate exists to stop (here: noise makes a plan hold both for a moment)."""
    policy = CapPolicy(cap=1, victim="a")
    sched = make_scheduler(policy)
    a = add(sched, "a", max_tokens=50)
    run(sched, sched.schedule())
    run(sched, sched.schedule())
    add(sched, "b", max_tokens=50, arrival=1.0)
    out = sched.schedule()
    run(sched, out)
    assert out.paused_ids == ["a"]
    policy.cap = 2
    add(sched, "c", max_tokens=50, arrival=2.0)  # waits behind the paused a, never runs
    sched.finish_requests(["c"], "abort")
    out = sched.schedule()
    assert not out.resumed_ids and a.status is Status.PAUSED
    run(sched, out)
    sched.finish_requests(["b"], "length")  # a request that held KV ends: now a may come back
    assert sched.schedule().resumed_ids == ["a"]


def test_a_lone_request_paused_in_its_chunked_prefill_steps_aside_instead_of_failing():
    """A re-plan in the middle of a chunked prefill finds no plan holding the lone request beside a paused request's
    KV: its prefill chunk is progress, so it steps aside (it ended with an error, although it can be served); both
    then finish."""
    policy = CrowdedPolicy(cap=1, victim="a")
    sched = make_scheduler(policy, chunked_prefill=16)
    policy.scheduler = sched
    sched.controller._settle = lambda reqs: policy.plan(reqs, sched.controller.ctx)
    a = add(sched, "a", prompt=20, max_tokens=8)
    for _ in range(3):
        run(sched, sched.schedule())
    b = add(sched, "b", prompt=200, max_tokens=4, arrival=1.0)
    out = sched.schedule()
    run(sched, out)
    assert out.paused_ids == ["a"] and 0 < b.num_cached < b.num_prompt and "a" in sched.kv.tables
    policy.crowded = {"b"}  # from now on no plan holds b beside a's KV
    sched.controller.forget()  # a re-plan (expiry, mismatch) while b prefills
    out = sched.schedule()
    assert out.paused_ids == ["b"] and b.status is Status.PAUSED and b.error is None
    policy.crowded = set()
    for _ in range(100):  # the engine's output processing ends a request at max_tokens
        if not sched.has_work():
            break
        run(sched, sched.schedule())
        sched.finish_requests([r.request_id for r in (a, b)
                               if not r.finished and len(r.output_ids) >= r.sampling.max_tokens], "length")
    assert (a.finish_reason, b.finish_reason) == ("length", "length") and len(b.output_ids) == 4
    assert sched.kv.usage() == (0, 0)


def test_a_request_back_from_a_pause_may_be_the_victim_again_of_a_newcomer():
    """Paper 4.4: when the server is overloaded again, the victim may be "a new or previously paused request", even
    one resumed in the same pass (keeping it and making the newcomer wait cost TPOT attainment on the simulator:
    0.909 -> 0.872 at SLO scale 1, rate scale 3, 5 seeds). It is paused again, keeps its KV, and the newcomer runs."""
    sched = make_scheduler(CapPolicy(cap=2, victim="a"))
    a = add(sched, "a", max_tokens=100)
    add(sched, "b", max_tokens=100)
    run(sched, sched.schedule())
    add(sched, "c", max_tokens=100, arrival=1.0)
    out = sched.schedule()
    run(sched, out)
    assert out.paused_ids == ["a"]
    add(sched, "d", max_tokens=100, arrival=2.0)
    sched.finish_requests(["b"], "length")
    sched.take_finished()
    out = sched.schedule()
    assert out.resumed_ids == ["a"] and out.paused_ids == ["a"] and a.status is Status.PAUSED and a.num_pauses == 2
    assert ids(sched.running) == ["c", "d"] and "a" in sched.kv.tables and sched.controller.plan_ids == ["c", "d"]


class ListPolicy(CapPolicy):
    """Feasible while the batch has at most `cap` requests (1 with d in it); otherwise the first of `victims` in the
    batch."""

    def __init__(self, cap: int, victims: list[str]):
        super().__init__(cap)
        self.victims = victims

    def plan(self, requests, ctx):
        ids = [r.request_id for r in requests]
        cap = self.cap
        self.cap = 1 if "d" in ids else cap
        try:
            plan = super().plan(requests, ctx)
        finally:
            self.cap = cap
        return plan if plan.feasible else dataclasses.replace(plan, victims=tuple(v for v in self.victims if v in ids))


def test_a_newcomer_refused_after_all_pauses_nobody():
    """Admitting d takes two victims in turn: b, then d itself. d waits, and b, set aside on the way, is not paused
    for nothing (it was, and then waited for a completion)."""
    policy = ListPolicy(cap=3, victims=["a"])
    sched = make_scheduler(policy)
    a = add(sched, "a", max_tokens=100)
    add(sched, "b", max_tokens=100)
    add(sched, "c", max_tokens=100)
    run(sched, sched.schedule())
    policy.cap = 2
    sched.controller.forget()
    out = sched.schedule()
    run(sched, out)
    assert out.paused_ids == ["a"]
    policy.victims = ["b", "d"]
    add(sched, "d", max_tokens=100, arrival=1.0)
    sched.finish_requests(["c"], "length")
    sched.take_finished()
    out = sched.schedule()  # a is back beside b; d would need b set aside, and then itself
    assert out.resumed_ids == ["a"] and not out.paused_ids and a.status is Status.RUNNING
    assert ids(sched.running) == ["b", "a"] and ids(sched.waiting) == ["d"]
    assert sched.controller.plan is not None and sched.controller.plan_ids == ["b", "a"]


def test_a_paused_request_is_not_resumed_when_that_would_pause_someone():
    sched = make_scheduler(CapPolicy(cap=1, victim="b"))
    add(sched, "a")
    run(sched, sched.schedule())
    add(sched, "b")
    out = sched.schedule()  # b is the victim of its own admission: it waits, nobody is paused
    assert ids(sched.waiting) == ["b"] and not out.paused_ids and sched.controller.plan is not None


def test_no_output_row_asks_for_kv_the_manager_refused():
    # The plan keeps every layer on an 8-block device: the two prompts (1 block x 4 layers each) fill it, and
    # the first decode needs a second block per layer that neither can get.
    sched = make_scheduler(CapPolicy(cap=2), device_blocks=8, host_blocks=32)
    add(sched, "a", prompt=16, max_tokens=2)
    add(sched, "b", prompt=16, max_tokens=2)
    out = sched.schedule()
    assert [s.req_id for s in out.seqs] == ["a", "b"] and sched.kv.usage() == (8, 0)
    run(sched, out)
    out = sched.schedule()
    assert out.is_empty and sched.kv.usage() == (8, 0)  # refused: no row, nothing half-grown
    assert sched.controller.plan is None  # dropped: the next step re-plans
    assert all(sched.kv.tables[r].blocks_per_layer == 1 for r in "ab")


def test_the_admission_check_holds_new_requests_until_kv_frees():
    sched = make_scheduler(CapPolicy(cap=4), device_blocks=8, host_blocks=8)
    add(sched, "a", prompt=16, max_tokens=16)  # grows to 2 blocks x (4 layers + 1 prefetch) = 10 of 16
    add(sched, "b", prompt=16, max_tokens=16)  # 20 > 16: waits
    out = sched.schedule()
    assert [s.req_id for s in out.seqs] == ["a"] and ids(sched.waiting) == ["b"]
    sched.finish_requests(["a"], "abort")
    out = sched.schedule()
    assert [s.req_id for s in out.seqs] == ["b"] and sched.kv.usage() == (4, 0)


@pytest.mark.parametrize("order, first", [("fcfs", "long"), ("srtf", "short")])
def test_admission_order(order, first):
    sched = make_scheduler(CapPolicy(cap=1), scheduling=order)
    add(sched, "long", max_tokens=8, arrival=0.0)
    add(sched, "short", max_tokens=2, arrival=1.0)
    out = sched.schedule()
    assert [s.req_id for s in out.seqs] == [first]


def test_an_expiry_is_solved_ahead_for_the_batch_as_it_will_be_then():
    """The background solve of an expiry starts Controller.lead_steps() before it (here 3), for the requests as
    they will be at the expiry: that many tokens longer."""

    class Expiring(CapPolicy):
        replan_on = frozenset({"batch", "expiry"})

    sched = make_scheduler(Expiring(cap=4))
    sched.controller = controller = Controller(Expiring(cap=4), sched.controller.ctx, background="thread")
    try:
        controller.lead_steps = lambda: 3
        submitted, tokens_at = [], {}
        real = controller.solve_ahead
        controller.solve_ahead = lambda reqs, step_next: submitted.append(
            (sched.step, step_next, [r.tokens for r in reqs])) or real(reqs, step_next)
        req = add(sched, "a", prompt=20, max_tokens=40)
        for _ in range(12):
            tokens_at[sched.step] = req.num_tokens
            run(sched, sched.schedule())
        # the plans last 8 steps (CapPolicy's window) from step 0, so the one for step 8 is solved from step 5 on
        assert submitted[0] == (5, 8, [tokens_at[8]]) and tokens_at[8] == tokens_at[5] + 3
        assert controller.records[-1].background and controller.records[-1].step == 8
        assert req.status is Status.RUNNING
    finally:
        controller.close()


@pytest.mark.parametrize("step_s", [0.010, 0.014])  # faster than the pace (banks), slower (spends the bank)
def test_a_solve_ahead_sees_the_deposit_its_step_will_have(step_s):
    """A solve started 3 steps before its expiry planned with the Token-Deposit balance of its start. Over steps
    that take what the plan in force predicts for each (longer as the KV grows), the balance it sees must be the one
    its step then has."""
    from orbitflow.plan import Placement, Plan

    class Expiring(CapPolicy):
        replan_on = frozenset({"batch", "expiry"})

        def plan(self, requests, ctx):
            ids = tuple(r.request_id for r in requests)
            return Plan(ids, Placement.from_distances(self.layers, [None] * len(ids)), (None,) * len(ids), True, 8,
                        None, step_s, step_latencies_s=tuple(step_s + 2e-4 * k for k in range(8)))

    clock = VirtualClock()
    sched = make_scheduler(Expiring(cap=4))
    sched.now = clock.now
    sched.controller = controller = Controller(Expiring(cap=4), sched.controller.ctx, background="thread")
    try:
        controller.lead_steps = lambda: 3
        seen, actual = [], {}
        real = controller.solve_ahead
        controller.solve_ahead = lambda reqs, step_next: seen.append((step_next, reqs[0].deposit)) or real(reqs,
                                                                                                             step_next)
        req = Request("a", list(range(1, 21)), SamplingParams(max_tokens=40), 0.0, 0.012, TokenDeposit(0.012))
        sched.add_request(req)
        for _ in range(6):  # 5 paces banked before the first step
            req.deposit.push(7, clock.now())
        for _ in range(12):
            actual[sched.step] = sched.plan_inputs(sched.running)[0][0].deposit if sched.running else None
            out = sched.schedule()
            clock.advance(controller.plan.step_latencies_s[sched.step - controller.plan_step])  # as predicted
            req.deposit.push(7, clock.now())
            run(sched, out)
        step_next, deposit = seen[0]
        assert step_next == 8 and actual[8] > 0
        assert deposit == pytest.approx(actual[8], abs=1e-9)  # was actual[5]
        assert (deposit > actual[5]) == (step_s < 0.012)
    finally:
        controller.close()


def serve_alone(sched: Scheduler, req: Request, steps: int = 200) -> list:
    """Run the scheduler until `req` ends, finishing it at `max_tokens` as the engine's stop check would; the
    outputs of the steps it ran in."""
    outs = []
    for _ in range(steps):
        if req.finished:
            return outs
        out = sched.schedule()
        if out.seqs:
            run(sched, out)
            outs.append(out)
        if not req.finished and req.remaining_tokens == 0:
            sched.finish_requests([req.request_id], "length")
    raise AssertionError(f"{req.request_id} did not finish in {steps} steps")


def orbitflow_scheduler(device_blocks: int, host_blocks: int, victim="largest-kv+deposit") -> Scheduler:
    """The scheduler with OrbitFlow's own planner (pruned space) at the serving default alpha = 0.5, whose
    steps take 4 ms whatever the placement."""
    from dataclasses import replace

    from orbitflow.policies.orbitflow import OrbitFlowPolicy

    sched = make_scheduler(OrbitFlowPolicy(), device_blocks=device_blocks, host_blocks=host_blocks)
    ctx = replace(sched.controller.ctx, alpha=0.5, victim=victim)
    sched.controller = Controller(OrbitFlowPolicy(), ctx, background=False)
    return sched


def oldest_of_the_largest(reqs) -> list:
    """Most KV plus deposit first, the oldest first among equals (the default rule takes the newest)."""
    return [q.request_id for q in sorted(reqs, key=lambda q: -(q.blocks_per_layer * LAYERS + q.deposit))]


def add_with_slo(sched: Scheduler, rid: str, prompt: int, max_tokens: int, slo_s: float) -> Request:
    req = Request(rid, list(range(1, prompt + 1)), SamplingParams(max_tokens=max_tokens), 0.0, slo_s,
                  TokenDeposit(slo_s))
    sched.add_request(req)
    return req


def test_a_lone_request_whose_slo_no_placement_meets_runs_best_effort():
    """Nothing can be paused for a lone request: an SLO it cannot meet costs SLO misses, not an error."""
    sched = orbitflow_scheduler(device_blocks=64, host_blocks=64)
    req = add_with_slo(sched, "a", prompt=16, max_tokens=24, slo_s=1e-4)  # every step takes 4 ms
    serve_alone(sched, req)
    assert req.finish_reason == "length" and req.error is None and len(req.output_ids) == 24
    assert all(r.feasible and r.predicted_step_s > 1e-4 for r in sched.controller.records)  # every step misses


def test_a_lone_request_that_only_a_placement_outside_the_pruned_space_holds_completes():
    """The reviewer's 500 in small: with 4 layers the pruned space offloads 0, 1, 2 or all 4 layers. Grown to 2
    blocks per layer the request fits a 5-block device budget only with at most 1 layer there (2 + 2 of prefetch
    buffer), and a 6-block host pool only with 1 layer kept on the device: 3 offloaded, which the pruned space does
    not hold. Its SLO is out of reach too. Admission rightly let it in (10 blocks of 11, and 3 + 1 layers fit);
    it used to end mid-way with 'does not fit the device KV budget even fully offloaded'."""
    sched = orbitflow_scheduler(device_blocks=5, host_blocks=6)
    req = add_with_slo(sched, "a", prompt=16, max_tokens=16, slo_s=1e-4)
    outs = serve_alone(sched, req)
    assert req.error is None and req.finish_reason == "length" and len(req.output_ids) == 16
    grown = [o.placement["a"] for o in outs if o.placement and sched.kv.blocks_for(o.seqs[0].start_pos) == 2]
    assert sum(row.count(True) for row in grown[-1:]) == 1  # the one placement that holds it: 1 layer on device
    assert sched.kv.usage() == (0, 0)


def test_a_request_no_layer_split_holds_is_rejected_before_it_runs():
    """Both pools together hold its 3 blocks x (4 layers + 1 of prefetch) = 15 blocks, but a layer's blocks live in
    one pool: the 7-block device holds 1 layer beside the buffer, the 8-block host 2 layers, and 1 + 2 < 4. It used
    to run until its KV grew and then end with an error; now it ends before its first step, naming the limit."""
    sched = orbitflow_scheduler(device_blocks=7, host_blocks=8)
    req = add_with_slo(sched, "big", prompt=16, max_tokens=32, slo_s=1.0)
    ok = add_with_slo(sched, "ok", prompt=16, max_tokens=8, slo_s=1.0)
    out = sched.schedule()
    assert [s.req_id for s in out.seqs] == ["ok"] and req.finish_reason == "error" and not req.output_ids
    assert "max_tokens (32)" in req.error and "--host-kv-blocks" in req.error
    assert [r.request_id for r in sched.take_finished()] == ["big"] and "big" not in sched.kv.tables
    run(sched, out)
    serve_alone(sched, ok)
    assert ok.error is None and len(ok.output_ids) == 8


def run_and_end_at_max_tokens(sched: Scheduler, out, reqs: list[Request]) -> None:
    """Play the executor for `out`, then end the running requests that reached max_tokens, as the engine's stop
    check would."""
    if out.seqs:
        run(sched, out)
    for r in reqs:
        if not r.finished and r.status is Status.RUNNING and r.remaining_tokens == 0:
            sched.finish_requests([r.request_id], "length")


def serve_all(sched: Scheduler, arrivals: list[tuple[str, int, int, int]], slo_s: float, steps: int = 300):
    """Add `(id, prompt, max_tokens, step)` requests at their steps and run until every one ends (at max_tokens,
    as the engine's stop check would); the requests, each step's output and the step each request ended at."""
    reqs, outs, ended = [], [], {}
    for step in range(steps):
        reqs += [add_with_slo(sched, rid, prompt=p, max_tokens=m, slo_s=slo_s) for rid, p, m, at in arrivals
                 if at == step]
        out = sched.schedule()
        outs.append(out)
        run_and_end_at_max_tokens(sched, out, reqs)
        for r in reqs:
            if r.finished:
                ended.setdefault(r.request_id, step)
        if len(reqs) == len(arrivals) and all(r.finished for r in reqs):
            return reqs, outs, ended
    raise AssertionError(f"still live after {steps} steps: {[r.request_id for r in reqs if not r.finished]}")


def test_a_lone_request_that_outgrows_the_room_paused_requests_leave_steps_aside_for_them():
    """Found by a random search of small pools. a is paused (4 blocks x 4 layers, all on the 27-block host) and b
    runs alone; grown to 6 blocks per layer, b fits the 23-block device with 2 layers and its prefetch buffer, so 2
    must go to the host, where 11 blocks are left beside a. It used to end with NO_FIT though the pools hold both
    (admission's check) and b alone; now it is paused, a resumes and ends, then b resumes and ends. The three have 4
    blocks per layer when b arrives: a victim rule that takes the oldest of equals pauses a for b (the default rule
    makes b wait)."""
    sched = orbitflow_scheduler(device_blocks=23, host_blocks=27, victim=oldest_of_the_largest)
    reqs, outs, ended = serve_all(sched, [("a", 45, 13, 0), ("c", 52, 29, 0), ("b", 58, 27, 5)], slo_s=1e-4)
    assert [(r.request_id, r.error, len(r.output_ids)) for r in reqs] == [("a", None, 13), ("c", None, 29),
                                                                          ("b", None, 27)]
    steps_b_paused = [i for i, o in enumerate(outs) if "b" in o.paused_ids]
    assert len(steps_b_paused) == 1 and "a" in outs[steps_b_paused[0] + 1].resumed_ids
    assert [i for i, o in enumerate(outs) if "b" in o.resumed_ids][0] > ended["a"]  # b waits for a to end
    assert sched.kv.usage() == (0, 0) and not sched.has_work()


def _paused_pair_blocking_each_other(monkeypatch) -> tuple[Scheduler, Request, Request]:
    """a paused (it keeps its KV) while b runs and decodes a token; from then on no plan holds both, nor either one
    beside the other's KV (CrowdedPolicy), so the next schedule() sets b aside as well."""
    policy = CrowdedPolicy(cap=1, victim="a")
    sched = make_scheduler(policy)
    policy.scheduler = sched
    # the controller's lone-request fallback (any uniform layer count) finds no placement either
    monkeypatch.setattr(sched.controller, "_settle", lambda requests: policy.plan(requests, sched.controller.ctx))
    a = add(sched, "a", max_tokens=8)
    run(sched, sched.schedule())
    b = add(sched, "b", max_tokens=8)
    out = sched.schedule()  # the batch of two holds no plan: the policy pauses a, which keeps its KV
    assert out.paused_ids == ["a"] and [s.req_id for s in out.seqs] == ["b"]
    run(sched, out, token=5)
    run(sched, sched.schedule(), token=6)  # b decodes a token
    policy.crowded, policy.victim = {"a", "b"}, None
    return sched, a, b


def test_paused_requests_that_cannot_run_beside_each_others_kv_recompute_instead_of_ending(monkeypatch):
    """The deadlock the step-aside rule could leave: nobody runs, and no paused request can run beside the others'
    KV. The last in line gives up its KV (it used to end with NO_FIT), the first runs to its end, then the other
    prefills its prompt and outputs again and decodes on from its last output; no block leaks."""
    sched, a, b = _paused_pair_blocking_each_other(monkeypatch)
    sched.controller.forget()
    out = sched.schedule()  # b has run a token since it started: it steps aside for a rather than end
    assert out.paused_ids == ["b"] and not out.seqs and not out.finished_ids and ids(sched.paused) == ["a", "b"]
    out = sched.schedule()  # a first (paused earlier), then b: each needs what the other holds, so b gives up its KV
    assert out.recomputed_ids == ["b"] and out.resumed_ids == ["a"] and [s.req_id for s in out.seqs] == ["a"]
    assert not out.finished_ids and b.status is Status.WAITING and "b" not in sched.kv.tables
    assert b.output_ids == [5, 6] and b.num_recomputes == 1 and a.num_recomputes == 0
    outs = []
    while not b.finished:
        out = sched.schedule()
        outs.append(out)
        run_and_end_at_max_tokens(sched, out, [a, b])
    first = next(o for o in outs if [s.req_id for s in o.seqs] == ["b"])
    assert a.finished  # b waits until a ends (the pair holds no plan), then computes its KV again:
    (seq,) = first.seqs  # its prompt and every output but the last, sampling nothing
    assert (seq.token_ids, seq.start_pos, seq.sample) == (b.prompt_ids + [5], 0, False)
    (seq,) = outs[outs.index(first) + 1].seqs  # then it decodes on from its last output
    assert (seq.token_ids, seq.start_pos, seq.sample) == ([6], 21, True)
    assert [(r.finish_reason, r.error, len(r.output_ids)) for r in (a, b)] == [("length", None, 8)] * 2
    assert sched.kv.usage() == (0, 0) and not sched.has_work()


def _steady_load(sched: Scheduler, steps: int, prefix: str, max_tokens: int = 3) -> int:
    """Run ``steps`` schedule/execute rounds with one newcomer always queued; returns how many were added."""
    added = 0
    for _ in range(steps):
        if not sched.waiting:
            added += 1
            add(sched, f"{prefix}{added}", max_tokens=max_tokens, arrival=float(added))
        out = sched.schedule()
        run(sched, out)
        for r in list(sched.running):
            if r.remaining_tokens == 0:
                sched.finish_requests([r.request_id], "length")
    return added


def test_a_request_is_paused_without_moving_on_at_most_max_idle_pauses_times_in_a_row(monkeypatch):
    """A completion lets the paused request back in; the next newcomer in the same pass overloads the batch, and the
    policy's victim is the request just resumed. That may happen MAX_IDLE_PAUSES times in a row; then it keeps its
    place (the newcomer waits). Before, under steady arrivals it was paused again before every first step: one token
    in 300 steps."""
    sched = make_scheduler(CapPolicy(cap=2, victim="a"), device_blocks=512, host_blocks=512)
    a = add(sched, "a", max_tokens=400)
    add(sched, "b0", max_tokens=3)
    streaks = []
    pause = sched._pause_request
    monkeypatch.setattr(sched, "_pause_request", lambda req, keep_plan=False: (
        pause(req, keep_plan), streaks.append(req.idle_pauses))[0])
    served = _steady_load(sched, 300, "b")
    assert max(streaks) == MAX_IDLE_PAUSES  # the rule is reached, and never passed
    assert len(a.output_ids) > 20 and served > 50  # both move on (before: 1 and 150)


def test_paused_requests_that_block_each_other_are_not_overtaken_by_newcomers(monkeypatch):
    """Two paused requests each need host KV the other holds; the deadlock breaks (one computes its KV again) once
    nothing runs. Newcomers used to be admitted past them, so something always ran and they stayed paused forever."""
    sched, a, b = _paused_pair_blocking_each_other(monkeypatch)
    sched.controller.forget()
    _steady_load(sched, 200, "c")
    assert a.finished and b.finished and a.num_recomputes + b.num_recomputes >= 1
    assert [(r.finish_reason, len(r.output_ids)) for r in (a, b)] == [("length", 8)] * 2


def test_a_request_no_plan_holds_alone_ends_with_no_fit_when_no_paused_request_holds_kv(monkeypatch):
    """Where nobody else's KV is in the way, a request that no plan (nor the controller's lone-request fallback)
    holds alone ends with NO_FIT: a new one at admission, a running one once it outgrows every plan."""
    policy = CapPolicy(cap=1)
    sched = make_scheduler(policy)
    monkeypatch.setattr(sched.controller, "_settle", lambda requests: policy.plan(requests, sched.controller.ctx))
    a = add(sched, "a", max_tokens=8)
    run(sched, sched.schedule())
    policy.cap = 0  # from now on no plan holds any batch
    sched.controller.forget()
    out = sched.schedule()
    assert out.finished_ids == ["a"] and a.error == NO_FIT and not out.paused_ids and not out.seqs
    b = add(sched, "b", max_tokens=8)
    out = sched.schedule()
    assert out.finished_ids == ["b"] and b.error == NO_FIT and not out.seqs and not b.output_ids
    assert sched.kv.usage() == (0, 0) and not sched.has_work()


@pytest.mark.parametrize("first_seed", range(2000, 2400, 100))
def test_random_small_pools_end_every_admitted_request_and_leak_no_block(first_seed):
    """Random batches on small pools with OrbitFlow's planner, arrivals and aborts at random steps: every request
    that was not refused on arrival ends at its max_tokens or by its abort, never with an error; the blocks the
    pools count are the blocks the requests' tables hold, after every step; nothing is left once all end. (This
    search found the lone request that outgrew the room the paused ones left it, at seed 2207.)"""
    import numpy as np

    for seed in range(first_seed, first_seed + 100):
        rng = np.random.default_rng(seed)
        sched = orbitflow_scheduler(device_blocks=int(rng.integers(6, 30)), host_blocks=int(rng.integers(4, 40)))
        arrivals = sorted(int(a) for a in rng.integers(0, 30, int(rng.integers(3, 9))))
        slo_s = float(rng.choice([1e-4, 3e-3, 5e-3, 8e-3, 1.0]))
        reqs, refused, aborted = [], set(), set()
        for step in range(600):
            for _ in range(arrivals.count(step)):
                req = add_with_slo(sched, f"r{len(reqs)}", prompt=int(rng.integers(1, 60)),
                                   max_tokens=int(rng.integers(1, 60)), slo_s=slo_s)
                reqs.append(req)
                if req.finished:
                    refused.add(req.request_id)
            if rng.random() < 0.02 and sched.requests:
                victim = str(rng.choice(sorted(sched.requests)))
                aborted.add(victim)
                sched.finish_requests([victim], "abort")
            run_and_end_at_max_tokens(sched, sched.schedule(), reqs)
            host = sum(table.host_blocks() for table in sched.kv.tables.values())
            held = sum(len(blocks) for table in sched.kv.tables.values() for blocks in table.blocks)
            assert sched.kv.usage() == (held - host, host), (seed, step)
            if len(reqs) == len(arrivals) and not sched.has_work():
                break
        assert not sched.has_work(), seed
        assert sched.kv.usage() == (0, 0), seed
        for r in reqs:
            if r.request_id in refused:
                assert "max_tokens" in r.error, seed  # fits_alone's refusal names what to change
            elif r.request_id in aborted:
                assert r.finish_reason == "abort", seed
            else:
                assert (r.finish_reason, r.error, len(r.output_ids)) == ("length", None, r.max_output_tokens), seed


def test_a_paused_requests_device_layers_give_way_to_the_prefetch_buffer():
    """The plan counts b's prefetch buffer inside the device budget, but the paused a's device layers were evicted
    only as far as a grow or a move asked: the step's staging slots found the budget taken and overflowed past it.
    Budget 10: a holds 8 (2 blocks x 4 layers); b's 2 device layers take 4 (one a layer evicted for them); b's
    buffer needs 2 more, so a second a layer gives way before the decode step."""
    sched = make_scheduler(PausesAForB(), device_blocks=10)
    add(sched, "a", max_tokens=50)
    run(sched, sched.schedule())
    add(sched, "b", max_tokens=50, arrival=1.0)
    out = sched.schedule()
    assert out.paused_ids == ["a"] and [s.req_id for s in out.seqs] == ["b"]  # b prefills: no fetch yet
    run(sched, out)
    out = sched.schedule()
    assert out.is_decode and [s.req_id for s in out.seqs] == ["b"]
    kv = sched.kv
    assert kv.tables["b"].on_device == [True, False, True, False] and kv.tables["b"].blocks_per_layer == 2
    assert kv.device_pool.num_free >= 2, "the prefetch buffer of b's host layers has no room in the budget"
    assert sum(kv.tables["a"].on_device) == 2  # two of a's layers evicted, the others stay for its resume
