"""`orbitflow bench` against a live server on a tiny random Llama with SmolLM2's tokenizer."""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest
from serve.live import live_server, make_server_llm

from orbitflow.bench.client import add_bench_parser, cmd_bench, replay, run_metrics, token_times
from orbitflow.bench.workload import Trace, TraceRequest

OUTPUTS = (5, 9, 1, 12)


@pytest.fixture(scope="module")
def server(tiny_chat_dir):
    with live_server(make_server_llm(tiny_chat_dir)) as live:
        yield live


def small_trace() -> Trace:
    reqs = [TraceRequest(f"r{i}", 0.15 * i, 20 + 13 * i, out) for i, out in enumerate(OUTPUTS)]
    reqs[1].prompt = "The planets move around the sun because"
    return Trace(reqs)


def test_replay_measures_every_token(server):
    trace = small_trace()
    result = asyncio.run(replay(server.url, trace, progress=False))
    assert result.errors == {}
    assert result.model == "tiny-chat"
    by_id = {r.request_id: r for r in result.records}
    for req in trace:
        rec = by_id[req.request_id]
        assert rec.output_tokens == len(rec.delivered) == req.output_tokens
        assert rec.finished_s is not None and rec.finished_s >= rec.delivered[-1]
        assert rec.arrival_s >= req.arrival_s - 1e-3
    m = run_metrics(result, slo_s=1.0)
    assert m.num_finished == len(OUTPUTS)
    assert m.total_output_tokens == sum(OUTPUTS)
    assert m.num_tbt_gaps == sum(n - 1 for n in OUTPUTS)
    assert m.ttft_mean_s > 0 and m.p50_ttft_s > 0
    assert 0 <= m.tbt_attainment <= 1 and m.tbt_mean_s >= 0
    assert m.tokens_per_s > 0 and m.makespan_s >= 0.45


def test_replay_sends_each_requests_slo_to_an_orbitflow_server(server):
    """The client times each request against its own SLO: the server must plan and pace it for the same one."""
    trace = small_trace()
    for i, req in enumerate(trace):
        req.slo_s = 0.25 + 0.125 * i
    result = asyncio.run(replay(server.url, trace, progress=False))
    assert result.errors == {}
    served = sorted(r.slo_s for r in list(server.llm.engine.finished)[-len(OUTPUTS):])
    assert served == pytest.approx(sorted(req.slo_s for req in trace))


def test_cli_generated_trace_writes_json(server, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers())
    out = tmp_path / "bench.json"
    args = parser.parse_args(["bench", "--url", server.url, "--generate", "3", "--rate", "20",
                              "--token-scale", "0.01", "--slo-ms", "500", "--json", str(out), "--quiet"])
    assert args.func(args) == 0
    assert "TBT attainment" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["metrics"]["num_finished"] == 3 and data["metrics"]["slo_s"] == 0.5
    assert [len(r["token_s"]) for r in data["requests"]] == [r["output_tokens"] for r in data["requests"]]


def test_a_run_where_every_request_fails_scores_no_attainment(server, tmp_path, capsys):
    """Every request asks for more output than the server's context holds (a text prompt, so the client cannot
    check it first) and gets a 400: no token was measured, so attainment is '-' and the JSON's statistics are null
    (standard JSON), not 100% and NaN."""
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers())
    trace, out = tmp_path / "long.json", tmp_path / "bench.json"
    reqs = [TraceRequest(f"r{i}", 0.0, 3, 5000) for i in range(2)]
    for r in reqs:
        r.prompt = "Hello there friend"
    Trace(reqs).save(trace)
    args = parser.parse_args(["bench", "--url", server.url, "--trace", str(trace), "--slo-ms", "500",
                              "--json", str(out), "--quiet"])
    assert args.func(args) == 1
    printed = capsys.readouterr().out
    assert "100.0%" not in printed and any(line.startswith("TBT attainment:") and line.endswith("-")
                                           for line in printed.splitlines())
    data = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"not standard JSON: {c}"))
    assert data["metrics"]["tbt_attainment"] is None and data["metrics"]["num_finished"] == 0
    assert len(data["errors"]) == 2


def test_unreachable_server_and_missing_slo_are_one_line_errors(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers())
    trace = tmp_path / "t.json"
    small_trace().save(trace)
    args = parser.parse_args(["bench", "--url", "http://127.0.0.1:9", "--trace", str(trace), "--slo-ms", "50"])
    assert cmd_bench(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("orbitflow bench: error: cannot reach the server at http://127.0.0.1:9")
    assert "\n" not in err
    args = parser.parse_args(["bench", "--trace", str(trace)])
    assert cmd_bench(args) == 2
    assert "--slo-ms is required" in capsys.readouterr().err


def test_artifact_trace_is_read_by_bench_and_needs_step_s(tmp_path, capsys):
    from orbitflow.bench.client import build_trace

    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers())
    path = tmp_path / "artifact.json"
    path.write_text(json.dumps({"requests": {"x": {"input_length": 12, "output_length": 3, "arrival_time": 20},
                                             "y": {"input_length": 7, "output_length": 2, "arrival_time": 0}}}))
    args = parser.parse_args(["bench", "--trace", str(path), "--step-s", "0.1"])
    trace = build_trace(args)
    assert [(r.request_id, r.arrival_s, r.input_tokens, r.output_tokens) for r in trace] == [
        ("y", 0.0, 7, 2), ("x", pytest.approx(2.0), 12, 3)]
    args = parser.parse_args(["bench", "--trace", str(path), "--slo-ms", "50"])
    assert cmd_bench(args) == 2
    assert "--step-s" in capsys.readouterr().err


def test_token_times_spreads_extra_tokens_by_text():
    chunks = [(1.0, "a"), (2.0, "abcdef"), (3.0, "")]
    assert token_times(chunks, 3) == [1.0, 2.0, 3.0]
    assert token_times(chunks, 5) == [1.0, 2.0, 2.0, 2.0, 3.0]
    assert token_times(chunks, None) == [1.0, 2.0, 3.0]
    assert token_times([], 4) == []
