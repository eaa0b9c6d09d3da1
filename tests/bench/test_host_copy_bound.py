"""benchmarks/host_copy_bound.py runs end to end on the real model at a small size and writes its fragment."""

import re

from benchmark_scripts import run_benchmark


def test_bound_runs_and_reports_a_ratio_no_better_than_free(tmp_path, monkeypatch, capsys):
    md = tmp_path / "bound.md"
    run_benchmark("host_copy_bound", monkeypatch, "--context", "64", "--batch", "1", "--steps", "3", "--repeats", "1",
                  "--md", str(md))
    out = capsys.readouterr().out
    ratios = {name: float(value) for name, value in re.findall(r"(none/half|none \+ copy\)) (\d+\.\d+)", out)}
    assert set(ratios) == {"none/half", "none + copy)"}
    assert 0 < ratios["none + copy)"] <= 1.0  # a copy that costs nothing would give exactly 1
    copied = re.search(r"copy alone per step\s+([\d.]+) ms\s+\((\d+) MiB", out)
    assert copied and float(copied.group(1)) > 0
    text = md.read_text()
    assert text.startswith("## Half on host") and "bound none/(none + copy)" in text and "Command:" in text
