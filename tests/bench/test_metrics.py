import math

import pytest

from orbitflow.bench.metrics import Column, RequestRecord, compute_metrics, format_summary, format_table


def rec(rid, arrival, times, delivered=None, slo=None, finished=None, pauses=0):
    return RequestRecord(request_id=rid, arrival_s=arrival, input_tokens=10, output_tokens=len(times),
                         generated_s=times, delivered_s=delivered, slo_s=slo,
                         finished_s=finished if finished is not None else (times[-1] if times else None),
                         num_pauses=pauses)


def test_gaps_exactly_at_slo_count_as_met():
    # Gaps 0.1 computed from float timestamps (1.1 - 1.0 = 0.10000000000000009) still meet 0.1.
    r = rec("a", 0.5, [1.0, 1.1, 1.2, 1.3])
    m = compute_metrics([r], slo_s=0.1)
    assert m.tbt_attainment == 1.0
    assert m.tbt_violations == 0
    assert m.tpot_attainment == 1.0


def test_known_answers():
    # Request a: gaps 0.1, 0.3, 0.1 (one violation at SLO 0.2); tpot = 0.5/3.
    a = rec("a", 0.0, [1.0, 1.1, 1.4, 1.5], finished=1.5, pauses=1)
    # Request b: single token, counts as meeting TPOT; TTFT 0.5.
    b = rec("b", 1.0, [1.5], finished=1.5)
    # Request c: gaps 0.5, 0.5 -> both violate; tpot 0.5.
    c = rec("c", 2.0, [2.5, 3.0, 3.5], finished=4.0)
    m = compute_metrics([a, b, c], slo_s=0.2, device_mem_util=[0.5, 0.7], solver_calls=3, solver_time_s=0.01)
    assert m.num_tbt_gaps == 5
    assert m.tbt_attainment == pytest.approx(2 / 5)
    assert m.tbt_violations == 3
    assert m.tpot_attainment == pytest.approx(2 / 3)
    assert m.tpot_mean_s == pytest.approx((0.5 / 3 + 0.5) / 2)
    assert m.ttft_mean_s == pytest.approx((1.0 + 0.5 + 0.5) / 3)
    assert m.e2e_mean_s == pytest.approx((1.5 + 0.5 + 1.5) / 3)
    assert m.p50_tbt_s == pytest.approx(0.3)
    assert m.makespan_s == pytest.approx(4.0)
    assert m.throughput_rpm == pytest.approx(3 / 4.0 * 60)
    assert m.tokens_per_s == pytest.approx(8 / 4.0)
    assert m.total_output_tokens == 8
    assert m.num_pauses == 1
    assert m.device_mem_util == pytest.approx(0.6)
    assert m.solver_calls == 3
    d = m.to_dict()
    for key in ("p95_tbt_s", "p99_tbt_s", "p95_tpot_s", "e2e_mean_s", "throughput_rpm", "tokens_per_s",
                "tbt_attainment_generated", "device_mem_util"):
        assert key in d


def test_deposit_delivered_vs_generated():
    # Generated with a 0.4 s stall; the deposit paces delivery every 0.15 s.
    gen = [1.0, 1.05, 1.10, 1.50, 1.55]
    dlv = [1.0, 1.15, 1.30, 1.50, 1.65]
    m = compute_metrics([rec("a", 0.0, gen, delivered=dlv)], slo_s=0.2)
    assert m.tbt_attainment == 1.0
    assert m.tbt_attainment_generated == pytest.approx(3 / 4)
    assert m.tbt_violations == 0 and m.tbt_violations_generated == 1
    assert m.ttft_mean_s == pytest.approx(1.0)
    assert m.e2e_mean_s == pytest.approx(1.65)


def test_per_request_slo_and_missing_slo():
    r = rec("a", 0.0, [0.0, 0.3], slo=0.5)
    assert compute_metrics([r]).tbt_attainment == 1.0
    assert compute_metrics([r], slo_s=0.1).tbt_attainment == 1.0  # the record's own SLO wins
    with pytest.raises(ValueError, match="slo_s"):
        compute_metrics([rec("b", 0.0, [0.0, 0.3])])


def test_unfinished_and_empty():
    r = RequestRecord("a", 0.0, 10, 5, generated_s=[], finished_s=None)
    m = compute_metrics([r], slo_s=0.1)
    assert m.num_finished == 0 and math.isnan(m.p95_tbt_s)
    # no gap measured: no TBT attainment (it was 100%, so a run that served nothing scored perfectly); the request
    # itself was submitted and not served: a TPOT miss
    assert math.isnan(m.tbt_attainment) and math.isnan(m.tbt_attainment_generated) and m.tpot_attainment == 0.0
    assert "TBT attainment:" in format_summary(m.to_dict()) and "100.0%" not in format_summary(m.to_dict())
    m = compute_metrics([], slo_s=0.1)
    assert m.num_requests == 0 and math.isnan(m.throughput_rpm) and math.isnan(m.tbt_attainment)
    assert math.isnan(m.tpot_attainment)


def test_requests_not_served_count_as_tpot_misses():
    """TPOT attainment is the share of the requests submitted: one that failed before any token, one aborted after
    two tokens in time, and two refused before they ran (no record) are misses, not left out."""
    good = rec("good", 0.0, [1.0, 1.1, 1.2])
    failed = RequestRecord("failed", 0.0, 10, 50, generated_s=[], finished_s=None)
    aborted = RequestRecord("aborted", 0.0, 10, 50, generated_s=[1.0, 1.1], finished_s=None)
    assert compute_metrics([good, failed], slo_s=0.2).tpot_attainment == 0.5
    assert compute_metrics([good, aborted], slo_s=0.2).tpot_attainment == 0.5
    m = compute_metrics([good], slo_s=0.2, rejected=2)
    assert m.tpot_attainment == pytest.approx(1 / 3) and m.num_requests == 3 and m.to_dict()["rejected"] == 2
    none_served = compute_metrics([], slo_s=0.2, rejected=2)  # every request refused: a rate of 0, not unknown
    assert none_served.throughput_rpm == 0.0 and none_served.tokens_per_s == 0.0
    assert math.isnan(compute_metrics([], slo_s=0.2).throughput_rpm)  # nothing submitted: nothing to measure
    assert m.tbt_attainment == 1.0  # per delivered gap: nothing delivered, nothing counted


def test_record_validation():
    with pytest.raises(ValueError, match="non-decreasing"):
        RequestRecord("a", 0.0, 1, 2, generated_s=[1.0, 0.5])
    with pytest.raises(ValueError, match="delivered_s"):
        RequestRecord("a", 0.0, 1, 2, generated_s=[1.0, 1.5], delivered_s=[1.0])


def test_format_table_aligns():
    rows = [{"policy": "orbitflow", "tbt": 0.8561, "n": 3}, {"policy": "ds", "tbt": None, "n": 12}]
    text = format_table(rows, ["policy", Column("tbt", "TBT att.", ".1%"), ("n", "N")], title="Runs")
    lines = text.splitlines()
    assert "Runs" in lines[0]
    assert lines[1].split() == ["policy", "TBT", "att.", "N"]
    assert "85.6%" in lines[3] and "-" in lines[4]
    # Numbers right-aligned under their header.
    assert lines[3].index("85.6%") + len("85.6%") == lines[1].index("att.") + len("att.")
    assert lines[3].endswith(" 3") and lines[4].endswith("12")


def test_format_summary():
    m = compute_metrics([rec("a", 0.0, [1.0, 1.1])], slo_s=0.1)
    text = format_summary(m)
    assert "TBT attainment:" in text and "100.0%" in text
    assert "P95 TBT (ms):" in text
