"""benchmarks/gpu_reprice.py rebuilds the recorded predictions exactly, and prices the variants."""

import gzip
import json
import re
from pathlib import Path

import pytest
from benchmark_scripts import load_benchmark

RUN = str(Path(__file__).resolve().parents[2] / "docs" / "results" / "gpu_runs" / "3a.json.gz")


def test_it_rebuilds_every_recorded_prediction_and_prices_the_variants(capsys):
    bench = load_benchmark("gpu_reprice")
    assert bench.main([RUN]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 3a.json.gz")]
    assert [row.split(" | ")[1] for row in rows] == ["edf", "preemptive"]
    for row in rows:
        assert len(re.findall(r"[+-]\d+\.\d%", row)) == 4


def test_a_step_priced_by_another_model_is_refused(tmp_path):
    bench = load_benchmark("gpu_reprice")
    with gzip.open(RUN, "rt", encoding="utf-8") as fh:
        data = json.load(fh)
    run = data["results"][0]["overlap"][0]
    run["per_step"][3]["predicted_s"] *= 1.01
    with pytest.raises(ValueError, match="not the recorded model"):
        bench.reprice(run)
