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
