"""benchmarks/make_results.py --stages none: the page is re-assembled from the fragments on disk, with the
simulator section's provenance line, and nothing is re-run."""

import json
import subprocess
import sys
from pathlib import Path

from benchmark_scripts import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


def test_stages_none_reassembles_the_page_from_the_fragments(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    provenance = "> **Which code made the simulator section.** commit abc1234"
    (results / "simulator.md").write_text(f"{provenance}\n\n## Setup\n\nx\n")
    (results / "cluster.md").write_text("Routers compared on the cluster simulator.\n")
    subprocess.run([sys.executable, "benchmarks/make_results.py", "--stages", "none", "--docs", str(tmp_path)],
                   cwd=ROOT, check=True, capture_output=True, timeout=120)
    page = (tmp_path / "results.md").read_text()
    assert "python benchmarks/make_results.py --stages none" in page
    assert "commit abc1234" in page and "## Setup" in page
    assert "## Scale-out: routers on a simulated cluster\n\nRouters compared" in page
    assert "simulator runs" not in page and "re-assembled" in page  # nothing was simulated by this invocation


def test_resume_tells_the_runs_of_this_code_from_those_of_other_code(tmp_path):
    """A cached run is reused by --resume only if the code that made it hashes as this checkout's does: an edit to
    any file under the source tree (committed or not) changes the hash; --resume-any-code takes the others too."""
    mr = load_benchmark("make_results")
    src = tmp_path / "src"
    (src / "plan").mkdir(parents=True)
    (src / "plan" / "search.py").write_text("x = 1\n")
    (src / "__pycache__").mkdir()
    (src / "__pycache__" / "a.pyc").write_bytes(b"junk")
    before = mr.code_version(src)
    (src / "__pycache__" / "a.pyc").write_bytes(b"other junk")  # byte code is not the code
    assert mr.code_version(src) == before
    (src / "plan" / "search.py").write_text("x = 2\n")
    after = mr.code_version(src)
    assert after != before
    (src / "plan" / "search.py").write_text("x = 1\n")
    (src / "presets.json").write_text("{}")  # a new file (a preset) is code too
    assert mr.code_version(src) not in (before, after)

    cache = tmp_path / "sim_runs.jsonl"
    lines = [{"key": "a", "metrics": {"v": 1}, "commit": "old", "code": before},
             {"key": "a", "metrics": {"v": 2}, "commit": "new", "code": after},
             {"key": "b", "metrics": {"v": 3}, "commit": "old", "code": before},
             {"key": "c", "metrics": {"v": 4}, "commit": "older"}]  # cached before the hash was kept
    cache.write_text("".join(json.dumps(rec) + "\n" for rec in lines))
    mine, other = mr.cached_runs(cache, after)
    assert {k: r["metrics"]["v"] for k, r in mine.items()} == {"a": 2}
    assert {k: r["metrics"]["v"] for k, r in other.items()} == {"a": 1, "b": 3, "c": 4}
    assert mr.code_version() == mr.code_version()  # the checkout's own tree hashes the same twice


def test_resume_any_code_without_resume_is_an_error_naming_the_flag(tmp_path):
    out = subprocess.run([sys.executable, "benchmarks/make_results.py", "--resume-any-code", "--stages", "none",
                          "--docs", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--resume-any-code goes with --resume" in out.stderr


def test_the_provenance_line_says_when_runs_were_not_made_by_the_commit_alone():
    mr = load_benchmark("make_results")
    line = mr._provenance({"commit": "abc1234", "runs": 10, "reused": 4, "made_by": {"0ld": ["orbitflow"]},
                           "reused_other_code": 4, "dirty": True}, 60.0)
    assert "abc1234 with uncommitted edits under src/orbitflow" in line
    assert "4 of them reused" in line and "0ld (orbitflow)" in line and "4 of them by code other than" in line
    clean = mr._provenance({"commit": "abc1234", "runs": 10, "reused": 0}, 60.0)
    assert "uncommitted" not in clean and "reused" not in clean and clean.endswith("1.0 min.")
    assert "edited while the runs ran" not in clean
    assert "edited while the runs ran" in mr._provenance({"commit": "abc1234", "runs": 10,
                                                          "changed_while_running": True}, 60.0)
