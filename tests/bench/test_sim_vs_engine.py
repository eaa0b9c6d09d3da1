"""benchmarks/sim_vs_engine.py: the error figures it reports, on hand-made steps."""

import math

import pytest
from benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def sve():
    return load_benchmark("sim_vs_engine")


def test_step_errors_split_the_stall_error(sve):
    S = sve.StepSample
    steps = [S(measured_s=0.10, sim_model_s=0.11, plan_s=0.10, measured_stall_s=0.02, sim_stall_s=0.04,
               transfer_stall_s=0.01),
             S(measured_s=0.20, sim_model_s=0.18, plan_s=None, measured_stall_s=0.02, sim_stall_s=0.04,
               transfer_stall_s=0.03)]
    e = sve.step_errors(steps)
    assert e["steps"] == 2
    assert e["step_err_median"] == pytest.approx(0.10)  # |+10%| and |-10%|
    assert e["stall_err"] == pytest.approx(1.0)  # 0.08 predicted against 0.04 measured
    assert e["stall_err_transfer"] == pytest.approx(0.0)  # the transfer model alone is right here
    assert math.isnan(sve.step_errors([])["stall_err_transfer"])


def test_the_transfer_model_alone_does_not_count_the_host_layers_extra_twice(sve):
    """Fed the very compute the model predicts for a step (its host layers' extra included), the transfer model
    alone must give the model's own stall; it gave less at depth 2, where that extra overlaps the link."""
    import numpy as np

    from orbitflow.plan import CostModel, Placement

    model = CostModel([2e-3] * 8, 100.0, prefetch_slots=2, transfer_latency_s=2e-4, host_layer_s=4e-4)
    placement = Placement.from_distances(8, [1, 2])
    est = model.step(placement, [30, 20])
    assert est.stall_s > 0 and (est.compute_per_layer_s > 2e-3).any()
    assert sve.transfer_stall(model, placement.host, [30, 20], est.compute_per_layer_s) == pytest.approx(est.stall_s)
    plain = CostModel([2e-3] * 8, 100.0, prefetch_slots=2, transfer_latency_s=2e-4)  # no extra: nothing taken off
    est = plain.step(placement, [30, 20])
    assert sve.transfer_stall(plain, placement.host, [30, 20], np.full(8, 2e-3)) == pytest.approx(est.stall_s)


def keys(*order):
    return {p: (i, 0.0) for i, p in enumerate(order)}


def test_kendall_tau_allows_no_swap_at_0_9(sve):
    order = ["a", "b", "c", "d", "e"]
    assert sve.kendall_tau(keys(*order), keys(*order)) == pytest.approx(1.0)
    assert sve.kendall_tau(keys(*order), keys("b", "a", "c", "d", "e")) == pytest.approx(0.8)  # one swap: below 0.9
    assert sve.kendall_tau(keys(*order), keys(*reversed(order))) == pytest.approx(-1.0)


def test_a_tie_is_neither_agreement_nor_disagreement(sve):
    """tau-b: the simulator predicting a and b equal (same attainment, same P95 TBT) costs less than predicting
    them in the wrong order, and more than predicting them in the right one."""
    engine = keys("a", "b", "c", "d", "e")
    tied = {**keys("a", "b", "c", "d", "e"), "b": (0, 0.0)}  # a and b tied
    tau = sve.kendall_tau(engine, tied)
    assert tau == pytest.approx(9 / math.sqrt(10 * 9))  # 0.949
    assert sve.kendall_tau(engine, keys("b", "a", "c", "d", "e")) < tau < 1.0
    rows = {"a": {"tbt_attainment": 0.98, "p95_tbt_s": 0.1}, "b": {"tbt_attainment": 0.98, "p95_tbt_s": 0.1},
            "c": {"tbt_attainment": 0.5, "p95_tbt_s": 0.2}}
    assert sve.ranking_text(sve.rank_keys(rows)) == "a = b > c"


def row(att, p95, se=0.0, samples=None):
    out = {"tbt_attainment": att, "tbt_attainment_se": se, "p95_tbt_s": p95}
    if samples is not None:
        out["tbt_attainment_samples"] = samples
    return out


def test_attainments_within_their_standard_errors_tie_and_p95_orders_them(sve):
    """The issue's rule: a tie in attainment is broken by P95 TBT. Measured means tie when their difference is
    within 1.96 standard errors; outside that, attainment orders them whatever the P95."""
    rows = {"near": row(0.25, 0.60, se=0.02), "steady": row(0.24, 0.24, se=0.005), "clear": row(0.40, 0.60, se=0.02)}
    k = sve.rank_keys(rows)
    assert k["clear"] < k["steady"] < k["near"]  # near/steady tie in attainment (0.01 < 1.96 * 0.021): P95
    strict = sve.rank_keys(rows, strict=True)
    assert strict["clear"] < strict["near"] < strict["steady"]
    assert sve.ranking_text(k) == "clear > steady >~ near"
    # without standard errors (one replay) only equal attainments tie
    assert sve.rank_keys({"x": row(0.25, 0.6), "y": row(0.24, 0.1)}) == {"x": (0, 0.6), "y": (1, 0.1)}
    # the engine's replays of one policy are noisy: the same pair measured again with a swapped mean agrees
    swapped = {"near": row(0.23, 0.60, se=0.02), "steady": rows["steady"]}
    pair = {p: rows[p] for p in ("near", "steady")}
    assert sve.kendall_tau(sve.rank_keys(pair), sve.rank_keys(swapped)) == pytest.approx(1.0)
    assert sve.kendall_tau(sve.rank_keys(pair, strict=True), sve.rank_keys(swapped, strict=True)) == -1.0


def test_a_chain_of_ties_is_one_group_so_the_ranking_is_transitive(sve):
    """a ties b and b ties c, a clearly beats c: pairwise that is a cycle; as one tie group the P95 TBT orders
    all three, the same way whatever order the rows come in."""
    rows = {"a": row(0.30, 0.30, se=0.02), "b": row(0.25, 0.20, se=0.02), "c": row(0.20, 0.10, se=0.02)}
    for order in (["a", "b", "c"], ["c", "b", "a"], ["b", "c", "a"]):
        shuffled = {p: rows[p] for p in order}
        assert sve.ranking(sve.rank_keys(shuffled)) == ["c", "b", "a"]
        assert sve.ranking_text(sve.rank_keys(shuffled)) == "c >~ b >~ a"


def test_paired_samples_resolve_what_independent_errors_would_call_a_tie(sve):
    """Replay k of every policy runs in the same round (seed k is the same noise seed): a policy that beats
    another in every replay by 0.02 while both swing by 0.1 together is ahead, not tied."""
    x = row(0.32, 0.5, se=0.058, samples=[0.22, 0.32, 0.42])
    y = row(0.30, 0.1, se=0.058, samples=[0.20, 0.30, 0.40])
    assert sve.attainment_tolerance(x, y) == pytest.approx(0.0)
    assert sve.rank_keys({"x": x, "y": y})["x"][0] == 0 and sve.rank_keys({"x": x, "y": y})["y"][0] == 1
    unpaired = {"x": row(0.32, 0.5, se=0.058), "y": row(0.30, 0.1, se=0.058)}
    assert sve.rank_keys(unpaired)["y"] < sve.rank_keys(unpaired)["x"]  # independent errors: a tie, P95 decides


def test_three_replays_tie_within_the_student_t_interval_not_the_normal_one(sve):
    """Three paired replays: the differences 0.01, 0.03, 0.02 have a standard error of 0.0058; the 95% interval's
    half-width is t(2) = 4.30 times it (0.025), not 1.96 times (0.011, which called the 0.02 apart a rank)."""
    x = row(0.32, 0.5, se=0.05, samples=[0.21, 0.33, 0.42])
    y = row(0.30, 0.1, se=0.05, samples=[0.20, 0.30, 0.40])
    assert sve.attainment_tolerance(x, y) == pytest.approx(4.303 * 0.01 / 3 ** 0.5)
    assert sve.rank_keys({"x": x, "y": y})["y"] < sve.rank_keys({"x": x, "y": y})["x"]  # a tie: P95 orders them


def test_mean_row_carries_the_standard_error_and_the_samples(sve):
    base = {k: 0.0 for k in sve.ROW_KEYS}
    mean = sve.mean_row([dict(base, tbt_attainment=a) for a in (0.2, 0.3, 0.4)])
    assert mean["tbt_attainment"] == pytest.approx(0.3)
    assert mean["tbt_attainment_se"] == pytest.approx(0.1 / math.sqrt(3))
    assert mean["tbt_attainment_samples"] == [0.2, 0.3, 0.4]
    assert sve.mean_row([dict(base, tbt_attainment=0.5)])["tbt_attainment_se"] == 0.0


@pytest.mark.parametrize("policy", ["deepspeed", "orbitflow"])
def test_engine_steps_are_charged_with_the_planners_model_at_its_depth(sve, tiny_llama, policy):
    """The per-step error compares each engine step with the model the planner plans with (DeepSpeed's depth 2
    included): measured against a depth-1 model, DeepSpeed's steps looked 56% off when the simulator was not."""
    from tiny_models import make_llm

    from orbitflow.plan import Placement
    from orbitflow.policies import make_policy

    llm = make_llm(tiny_llama, policy=make_policy(policy), link_gbps=0.01)
    try:
        mine, planner = sve.step_model(llm.profile, llm), llm.engine.controller.ctx.cost_model
        assert mine.prefetch_slots == planner.prefetch_slots == make_policy(policy).prefetch_slots
        placement = Placement.from_distances(mine.num_layers, [1, 1])
        assert mine.step(placement, [4, 6], 150).total_s == pytest.approx(planner.step(placement, [4, 6], 150).total_s)
    finally:
        llm.close()


def test_rerun_taus_compare_consecutive_engine_rankings(sve):
    def run(*order):
        return {"policies": {p: {"engine": row(0.9 - 0.1 * i, 0.1)} for i, p in enumerate(order)}}

    runs = [run("a", "b", "c"), run("a", "b", "c"), run("c", "b", "a")]
    assert sve.rerun_taus(runs) == [pytest.approx(1.0), pytest.approx(-1.0)]
    assert sve.rerun_taus(runs[:1]) == []


def test_render_rewrites_the_page_from_its_json_with_each_policy_s_stall_seconds(sve, tmp_path, monkeypatch, capsys):
    """--render runs nothing: the committed fidelity page's JSON gives the page again, each policy's row carrying the
    stalls' totals (engine / model) its stall error is made of."""
    import json
    from pathlib import Path

    source = Path(__file__).resolve().parents[2] / "docs" / "results" / "sim_fidelity.json"
    out = tmp_path / "page.md"
    monkeypatch.setattr("sys.argv", ["sim_vs_engine.py", "--render", str(source), "--md", str(out)])
    sve.main()
    page = out.read_text()
    last = json.loads(source.read_text())["runs"][-1]
    assert "| stall s | stall error |" in page
    assert ("counted twice" in page) == (not sve._host_layer_once(last))  # runs from before transfer_stall's fix
    for policy, v in last["policies"].items():
        row = next(line for line in page.splitlines() if line.startswith(f"| {policy} |"))
        engine, model = v["errors"]["stall_measured_s"], v["errors"]["stall_model_s"]
        assert f"| {engine:.3f}{sve._replay_range(v)} / {model:.3f} |" in row
    assert "(no run)" in capsys.readouterr().out


def test_a_page_says_which_split_of_the_stall_error_its_runs_made(sve):
    """Runs made before transfer_stall's fix counted a host layer's extra twice: a page rendered from them says so."""
    old = {"policies": {"deepspeed": {}}}
    assert not sve._host_layer_once(old)
    assert sve._host_layer_once({"policies": {"deepspeed": {"engine_stall_s_replays": [1.0]}}})
    assert sve._host_layer_once({"transfer_alone_host_layer_once": True, **old})


def test_each_policy_s_row_shows_the_engine_s_spread_over_its_replays(sve):
    v = {"engine_stall_s_replays": [1.0, 1.5, 1.2]}
    assert sve._replay_range(v) == " (3.00-4.50)"  # beside the total over the three, 3.7
    assert sve._replay_range({"engine_stall_s_replays": [1.0]}) == "" == sve._replay_range({})


def test_a_page_measured_on_a_noisy_machine_says_so(sve, tmp_path, monkeypatch):
    """The profiles' step jitter tells a noisy machine (its speed drifting under the runs) from a quiet one: the page
    says so above its numbers, and a quiet page does not."""
    import json
    from pathlib import Path

    payload = json.loads((Path(__file__).resolve().parents[2] / "docs" / "results" / "sim_fidelity.json").read_text())
    for cv, noisy in ((0.02, False), (0.09, True)):
        for run in payload["runs"]:
            run["profile"]["step_noise_cv"] = cv
        source, out = tmp_path / f"{cv}.json", tmp_path / f"{cv}.md"
        source.write_text(json.dumps(payload))
        monkeypatch.setattr("sys.argv", ["sim_vs_engine.py", "--render", str(source), "--md", str(out)])
        sve.main()
        assert ("**Taken while this machine was noisy**" in out.read_text()) == noisy


@pytest.mark.parametrize("argv,message", [(["--render", "x.json"], "give --md PATH"),
                                          (["--render", "{bad}", "--md", "page.md"], "not a --json file")])
def test_render_refuses_what_it_cannot_render(sve, tmp_path, monkeypatch, capsys, argv, message):
    bad = tmp_path / "bad.json"
    bad.write_text('{"runs": []}')
    argv = [a.replace("{bad}", str(bad)).replace("page.md", str(tmp_path / "page.md")) for a in argv]
    monkeypatch.setattr("sys.argv", ["sim_vs_engine.py", *argv])
    with pytest.raises(SystemExit) as exc:
        sve.main()
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "page.md").exists()
