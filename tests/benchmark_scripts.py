"""Import a script of benchmarks/ as a module, so tests can drive its parts without running the benchmark."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def run_benchmark(name: str, monkeypatch, *args: str) -> ModuleType:
    """Run the script's main() with ``args`` as its command line; the loaded module."""
    module = load_benchmark(name)
    monkeypatch.setattr(sys, "argv", [f"{name}.py", *args])
    module.main()
    return module
