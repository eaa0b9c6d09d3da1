"""Compare a sweep written by `python benchmarks/make_results.py` (docs/results/a5000.json) with the numbers the
paper's evaluation states: the reproduction table of docs/results.md, printed with 95% confidence intervals.

Run: python benchmarks/paper_claims.py docs/results/a5000.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from make_results import RATE_SCALES, Results, reproduction, reproduction_md  # noqa: E402

from orbitflow.sim.sweep import SimSetup  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json_path")
    args = ap.parse_args()
    data = json.load(open(args.json_path))
    if "config" not in data or not data["runs"] or "point" not in data["runs"][0]:
        raise SystemExit(f"{args.json_path}: not written by benchmarks/make_results.py (no 'config' / runs[].point)")
    runs = [r | {"_point": r["point"]} for r in data["runs"]]
    rates = tuple(data["config"].get("rate_scales") or RATE_SCALES)
    res = Results(runs, SimSetup())
    print("\n".join(reproduction_md(reproduction(res, rates))))


if __name__ == "__main__":
    main()
