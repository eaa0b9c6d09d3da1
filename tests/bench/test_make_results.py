"""benchmarks/make_results.py --stages none: the page is re-assembled from the fragments on disk, with the
simulator section's provenance line, and nothing is re-run."""

import subprocess
import sys
from pathlib import Path

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
