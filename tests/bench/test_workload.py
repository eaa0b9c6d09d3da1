import numpy as np
import pytest

from orbitflow.bench.workload import (
    LengthBins,
    Trace,
    TraceError,
    TraceRequest,
    generate_trace,
    interarrival_times,
    paper_default_rate_per_s,
    scale_arrivals,
    scale_trace,
    trace_stats,
)


def test_round_trip(tmp_path):
    trace = generate_trace(50, 0.5, seed=3, slo_s=0.1)
    trace.requests[0].prompt = "hello"
    path = trace.save(tmp_path / "t.json")
    back = Trace.load(path)
    assert back == trace
    assert Trace.from_json(trace.to_json()) == trace
    d = trace.to_dict()["requests"][0]
    assert set(d) == {"id", "arrival_s", "input_tokens", "output_tokens", "slo_s", "prompt"}
    assert "prompt" not in trace.to_dict()["requests"][1]


def test_validation_names_index_and_field():
    ok = {"id": "a", "arrival_s": 0.0, "input_tokens": 10, "output_tokens": 5}
    cases = [
        (dict(ok, input_tokens=0), r"requests\[1\]\.input_tokens"),
        (dict(ok, output_tokens=2.5), r"requests\[1\]\.output_tokens"),
        (dict(ok, arrival_s=-1), r"requests\[1\]\.arrival_s"),
        (dict(ok, slo_s=0), r"requests\[1\]\.slo_s"),
        (dict(ok, prompt=3), r"requests\[1\]\.prompt"),
        (dict(ok, id=""), r"requests\[1\]\.id"),
        ({k: v for k, v in ok.items() if k != "output_tokens"}, r"requests\[1\]\.output_tokens: missing"),
        (dict(ok, arival_s=1.0), r"requests\[1\].*arival_s"),
        (dict(ok, id="first"), r"requests\[1\]\.id: duplicate"),
    ]
    for bad, pattern in cases:
        with pytest.raises(TraceError, match=pattern):
            Trace.from_dict({"requests": [dict(ok, id="first"), bad]})
    with pytest.raises(TraceError, match="requests"):
        Trace.from_dict({"reqs": []})
    with pytest.raises(TraceError, match="invalid JSON"):
        Trace.from_json("{")


def test_trace_sorted_by_arrival():
    t = Trace([TraceRequest("b", 2.0, 1, 1), TraceRequest("a", 1.0, 1, 1)])
    assert [r.request_id for r in t] == ["a", "b"]
    assert t.duration_s == 1.0


@pytest.mark.parametrize("arrival", ["gamma", "lognormal"])
@pytest.mark.parametrize("cv", [0.5, 2.0, 4.0])
def test_interarrival_cv_and_mean(arrival, cv):
    gaps = interarrival_times(200_000, 2.0, arrival, cv, np.random.default_rng(7))
    assert gaps.mean() == pytest.approx(0.5, rel=0.05)
    # Heavy tails make the sample CV converge slowly for large cv.
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.05 if cv <= 2 else 0.15)


def test_poisson_cv_one_and_rejects_other_cv():
    gaps = interarrival_times(100_000, 1.0, "poisson", rng=np.random.default_rng(1))
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.03)
    with pytest.raises(ValueError, match="cv"):
        interarrival_times(10, 1.0, "poisson", cv=2.0)
    with pytest.raises(ValueError, match="arrival"):
        interarrival_times(10, 1.0, "uniform")


def test_generate_trace_rate_and_determinism():
    a = generate_trace(4000, 0.1, arrival="gamma", cv=2.0, seed=5, rate_scale=2.0)
    assert a == generate_trace(4000, 0.1, arrival="gamma", cv=2.0, seed=5, rate_scale=2.0)
    assert a != generate_trace(4000, 0.1, arrival="gamma", cv=2.0, seed=6, rate_scale=2.0)
    assert a.requests[0].arrival_s == 0.0
    stats = trace_stats(a)
    assert stats["rate_per_s"] == pytest.approx(0.2, rel=0.1)
    assert stats["interarrival_cv"] == pytest.approx(2.0, rel=0.1)


def test_lengths_within_bins_and_cap():
    bins = LengthBins()
    trace = generate_trace(3000, 1.0, seed=11)
    lo_in = [c * 0.8 for c in bins.input_centres]
    hi_in = [c * 1.2 for c in bins.input_centres]
    lo_out = [c * 0.8 for c in bins.output_centres]
    hi_out = [c * 1.2 for c in bins.output_centres]
    seen_in, seen_out = set(), set()
    for r in trace:
        i_bins = [k for k in range(3) if lo_in[k] - 1 <= r.input_tokens <= hi_in[k] + 1]
        o_bins = [k for k in range(3) if lo_out[k] - 1 <= r.output_tokens <= hi_out[k] + 1]
        assert i_bins and o_bins, r
        seen_in.update(i_bins)
        seen_out.update(o_bins)
        assert r.input_tokens + r.output_tokens <= 32768
    assert seen_in == seen_out == {0, 1, 2}
    shares = np.bincount([min(range(3), key=lambda k: abs(r.input_tokens - bins.input_centres[k]))
                          for r in trace], minlength=3) / len(trace)
    assert np.allclose(shares, bins.weights, atol=0.03)


def test_context_cap_clips_proportionally():
    bins = LengthBins(input_centres=(10_000,), output_centres=(6_000,), weights=(1.0,))
    trace = generate_trace(200, 1.0, length_bins=bins, context_cap=8192, seed=2)
    for r in trace:
        assert r.input_tokens + r.output_tokens <= 8192
        assert r.input_tokens > r.output_tokens >= 1


def test_scale_trace_and_arrivals():
    t = generate_trace(20, 1.0, seed=1)
    s = scale_trace(t, 0.01)
    for a, b in zip(t, s):
        assert b.input_tokens == max(1, round(a.input_tokens * 0.01))
        assert b.arrival_s == a.arrival_s and b.request_id == a.request_id
    fast = scale_arrivals(t, 2.0)
    assert fast.requests[-1].arrival_s == pytest.approx(t.requests[-1].arrival_s / 2)
    with pytest.raises(ValueError, match="token_scale must be > 0"):
        scale_trace(t, 0)


def test_paper_rate():
    assert paper_default_rate_per_s() == pytest.approx(0.97 / 60)


def test_artifact_trace_is_read_with_lengths_arrivals_and_budget(tmp_path):
    import json

    from orbitflow.bench.workload import load_trace_file

    data = {"requests": {"7": {"input_length": 1200, "output_length": 64, "arrival_time": 30},
                         "3": {"input_length": 800, "output_length": 16, "arrival_time": 0.0}},
            "config": {"num_gpu_blocks": 1000, "block_size": 32}}
    path = tmp_path / "artifact.json"
    path.write_text(json.dumps(data))
    loaded = load_trace_file(path, step_s=0.05)
    assert loaded.source_format == "artifact"
    assert [(r.request_id, r.arrival_s, r.input_tokens, r.output_tokens) for r in loaded.trace] == [
        ("3", 0.0, 800, 16), ("7", pytest.approx(1.5), 1200, 64)]
    assert loaded.device_kv_tokens == 32000
    assert loaded.device_kv_blocks(block_size=16, num_layers=32) == 2000 * 32
    # the project's own format still loads, with no budget
    own = tmp_path / "own.json"
    loaded.trace.save(own)
    again = load_trace_file(own)
    assert again.source_format == "orbitflow" and again.device_kv_tokens is None and len(again.trace) == 2


@pytest.mark.parametrize("requests, field", [
    ({"a": {"input_length": 0, "output_length": 4, "arrival_time": 0}}, "requests['a'].input_length"),
    ({"a": {"input_length": 5, "arrival_time": 0}}, "requests['a'].output_length: missing"),
    ({"a": {"input_length": 5, "output_length": 4, "arrival_time": -2}}, "requests['a'].arrival_time"),
    ({"a": {"input_length": 5, "output_length": 4, "arrival_time": "soon"}}, "requests['a'].arrival_time"),
    ({"a": [1, 2]}, "requests['a']: expected an object"),
    ({}, "no requests"),
])
def test_bad_artifact_trace_names_the_field(tmp_path, requests, field):
    import json

    from orbitflow.bench.workload import TraceError, load_trace_file

    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"requests": requests}))
    with pytest.raises(TraceError) as err:
        load_trace_file(path, step_s=0.1)
    assert field in str(err.value) and str(path) in str(err.value)


def test_artifact_trace_needs_step_s_and_a_sane_budget(tmp_path):
    import json

    from orbitflow.bench.workload import TraceError, load_trace_file

    path = tmp_path / "t.json"
    path.write_text(json.dumps({"requests": {"a": {"input_length": 5, "output_length": 4, "arrival_time": 1}}}))
    with pytest.raises(TraceError, match="--step-s"):
        load_trace_file(path)
    with pytest.raises(TraceError, match="--step-s"):
        load_trace_file(path, step_s=-1.0)
    path.write_text(json.dumps({"requests": {"a": {"input_length": 5, "output_length": 4, "arrival_time": 1}},
                                "num_gpu_blocks": "lots"}))
    with pytest.raises(TraceError, match="num_gpu_blocks"):
        load_trace_file(path, step_s=0.1)
    with pytest.raises(TraceError, match="no such file"):
        load_trace_file(tmp_path / "missing.json")
