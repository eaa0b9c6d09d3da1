"""benchmarks/gpu_smoke.py runs in CI: without CUDA it skips cleanly (exit 0), with --require-cuda it fails."""

import pytest
import torch
from benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def gpu_smoke():
    return load_benchmark("gpu_smoke")


def test_skips_cleanly_without_cuda(gpu_smoke, capsys, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: run benchmarks/gpu_smoke.py itself")
    md = tmp_path / "gpu_smoke.md"
    assert gpu_smoke.main(["--md", str(md)]) == 0
    assert "skipping" in capsys.readouterr().out
    assert not md.exists()  # nothing measured, nothing written
    assert gpu_smoke.main(["--require-cuda"]) == 2


def test_bad_flags_name_the_flag(gpu_smoke, capsys):
    with pytest.raises(SystemExit):
        gpu_smoke.main(["--prompts", "0"])
    assert "--prompts" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu_smoke.main(["--kv-links", "edf,fair"])
    assert "--kv-links" in capsys.readouterr().err
    for bad in ("16", "16,x", "0,256", "16,16", "8192,16,2048"):
        with pytest.raises(SystemExit):
            gpu_smoke.main(["--profile-contexts", bad])
        assert "--profile-contexts" in capsys.readouterr().err


def test_the_report_has_a_row_per_link(gpu_smoke, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "Fake GPU")
    args = gpu_smoke.parse_args([])
    identity = [{"link": link, "placement": "all", "identical": 4, "of": 4, "first_divergence": None,
                 "leaked": False, "preemptions": 0} for link in ("edf", "preemptive")]
    overlap = [{"link": "edf", "steps": 0},
               {"link": "preemptive", "steps": 31, "step_s": 0.012, "predicted_s": 0.011, "error_vs_prediction": 0.09,
                "late_error": -0.02, "compute_s": 0.010, "predicted_compute_s": 0.0095, "stall_s": 0.002,
                "predicted_stall_s": 0.0015, "link_busy_s": 0.008, "overlap": 0.75, "preemptions": 1.5,
                "max_protocol_syncs": 1, "max_cuda_sync_warnings": 0}]
    text = gpu_smoke.render([{"model": "m", "identity": identity, "overlap": overlap}], args, [])
    assert "| m | preemptive | all | 4/4 | - | no | 0 |" in text
    assert "WARNING: no fetch of the preemptive runs yielded the link" in text  # nothing showed the chunk path ran
    identity[1]["preemptions"] = 7
    assert "WARNING" not in gpu_smoke.render([{"model": "m", "identity": identity, "overlap": overlap}], args, [])
    assert "| m | edf | 0 |" in text
    expected = ("| m | preemptive | 31 | 12.00 | 11.00 | 9.0% | -2.0% | 10.00 | 9.50 | 2.00 | 1.50 | 8.00 | 75% | "
                "1.50 | 1 | 0 |")
    assert expected in text
    header = next(line for line in text.splitlines() if line.startswith("| model | link | steps"))
    empty = next(line for line in text.splitlines() if line.startswith("| m | edf | 0"))
    assert header.count("|") == expected.count("|") == empty.count("|")  # every column filled
    assert "fitted at contexts 16,256,768" in text
    skipped = gpu_smoke.render([{"model": "m", "identity": [], "overlap": overlap}],
                               gpu_smoke.parse_args(["--skip-identity", "--profile-contexts", "16,2048,8192"]), [])
    assert "not checked: --skip-identity" in skipped and "fitted at contexts 16,2048,8192" in skipped


def test_the_summary_takes_medians_of_numbers_only_whatever_the_count(gpu_smoke):
    """Each step also carries what its prediction priced (lists); an even count of steps must not average those."""
    def step(i):
        return {"step_s": 0.010 + 1e-3 * i, "stall_s": 0.002, "compute_s": 0.008, "link_busy_s": 0.004,
                "predicted_s": 0.010, "predicted_compute_s": 0.008, "predicted_stall_s": 0.002,
                "priced": {"on_device": [[True, False]], "blocks": [3]}, "protocol_syncs": 1, "preemptions": i % 2,
                "cuda_sync_warnings": 0}

    for n in (31, 32):
        med = gpu_smoke.summarize([step(i) for i in range(n)], "edf", {"name": "p"})
        assert med["steps"] == n and med["step_s"] == pytest.approx(0.010 + 1e-3 * (n - 1) / 2)
        assert "priced" not in med and med["per_step"][0]["priced"]["blocks"] == [3] and med["profile"] == {"name": "p"}
        assert med["overlap"] == pytest.approx(0.5) and med["max_protocol_syncs"] == 1
    assert gpu_smoke.summarize([], "edf") == {"link": "edf", "steps": 0}
