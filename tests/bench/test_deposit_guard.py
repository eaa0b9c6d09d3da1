"""benchmarks/deposit_guard.py runs end to end on the real model at a small size and writes its table."""

import re

from benchmark_scripts import run_benchmark


def test_guard_benchmark_runs_every_arm_and_writes_its_table(tmp_path, monkeypatch, capsys):
    md = tmp_path / "guard.md"
    run_benchmark("deposit_guard", monkeypatch, "--rounds", "2", "--streams", "1", "--tokens", "10",
                  "--guards", "0,auto", "--md", str(md))
    text = md.read_text()
    assert text.startswith("## Token-Deposit's guard band")
    rows = re.findall(r"^\| (0|auto) \| ([\d.]+) \| (\d+) \|", text, flags=re.M)
    slo_ms = float(re.search(r"SLO ([\d.]+) ms", text).group(1))
    assert [r[0] for r in rows] == ["0", "auto"]
    assert float(rows[0][1]) == 0 and float(rows[1][1]) == round(min(5.0, slo_ms / 10), 2)
    assert "missed vs guard 0" in capsys.readouterr().out
