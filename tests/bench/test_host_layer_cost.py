"""benchmarks/host_layer_cost.py: its placements count what they should, and it runs end to end on the real model."""

import re

from benchmark_scripts import load_benchmark


def test_the_cases_read_the_host_layers_they_say():
    bench = load_benchmark("host_layer_cost")
    cases = bench.placements(30, 4)
    assert {name: bench.counts(rows) for name, rows in cases.items()} == {
        "device": (0, 0), "one": (8, 8), "shared": (8, 32), "disjoint": (30, 30)}
    # a fifth request offloads the first one's layers
    assert bench.counts(bench.placements(32, 5)["disjoint"]) == (32, 40)
    extras = {"one": [0.008], "shared": [0.010], "disjoint": [0.020]}
    lines = bench.report(extras, cases)
    shared = next(line for line in lines if line.startswith("shared"))
    assert re.search(r"10\.00 \[10\.00, 10\.00\]\s+8\.00\s+32\.00$", shared)  # measured, per-layer rule, per-request
    assert "shared / disjoint: measured 0.50, per-layer rule 0.27, per-request rule 1.07" in lines


def test_it_runs_on_the_real_model_and_writes_its_fragment(tmp_path, capsys):
    bench = load_benchmark("host_layer_cost")
    md = tmp_path / "cost.md"
    assert bench.main(["--contexts", "32", "--repeats", "1", "--md", str(md)]) == 0
    out = capsys.readouterr().out
    assert all(re.search(rf"^{name}\s", out, re.M) for name in ("one", "shared", "disjoint"))
    text = md.read_text()
    assert "per-layer rule" in text and "Command: `python benchmarks/host_layer_cost.py --contexts 32" in text
