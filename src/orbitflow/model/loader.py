"""load_model: a built-in name, a Hugging Face model directory or a GGUF file -> ready-to-run model."""

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import load_file

from orbitflow.model.config import ModelConfig
from orbitflow.model.errors import ModelLoadError
from orbitflow.model.gguf_convert import ensure_converted
from orbitflow.model.llama import LlamaModel
from orbitflow.model.registry import resolve_model_path
from orbitflow.model.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    model: LlamaModel | None  # None: loaded without weights (load_model(weights=False))
    config: ModelConfig
    tokenizer: Tokenizer
    name: str
    path: Path  # the HF directory actually loaded (the conversion cache for GGUF files)


def load_model(name_or_path: str, dtype: torch.dtype = torch.float32, weights: bool = True) -> LoadedModel:
    """``weights=False``: config and tokenizer only (``model=None``), for the process that drives
    tensor-parallel ranks, which load their own shards."""
    model_dir = _model_dir_for(resolve_model_path(name_or_path))
    if weights:
        model, config = load_weights(model_dir, dtype)
    else:
        model, config = None, read_model_config(model_dir)
    if not (model_dir / "tokenizer.json").exists():
        raise ModelLoadError(f"no tokenizer.json in model directory {model_dir}")
    try:
        tokenizer = Tokenizer.from_dir(model_dir, extra_eos_token_ids=config.eos_token_ids)
    except Exception as exc:
        raise ModelLoadError(f"cannot read tokenizer in {model_dir}: {_one_line(exc)}") from exc
    if weights:
        configure_cpu_threads()
    return LoadedModel(model=model, config=config, tokenizer=tokenizer, name=name_or_path, path=model_dir)


def read_model_config(model_dir: Path) -> ModelConfig:
    """config.json, with EOS ids from generation_config.json merged in when present."""
    try:
        raw = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        config = ModelConfig.from_hf_config(raw)
        generation_file = model_dir / "generation_config.json"
        if generation_file.exists():
            generation = ModelConfig.from_hf_config({**raw, **json.loads(generation_file.read_text())})
            eos_ids = tuple(dict.fromkeys(config.eos_token_ids + generation.eos_token_ids))
            config = replace(config, eos_token_ids=eos_ids)
    except FileNotFoundError as exc:
        raise ModelLoadError(f"no config.json in model directory {model_dir}") from exc
    except Exception as exc:
        raise ModelLoadError(f"bad config.json in {model_dir}: {_one_line(exc)}") from exc
    return config


def load_weights(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> tuple[LlamaModel, ModelConfig]:
    """Model and config from an HF directory (no tokenizer needed)."""
    model_dir = Path(model_dir)
    config = read_model_config(model_dir)
    tensors: dict[str, torch.Tensor] = {}
    for file in safetensors_files(model_dir):
        try:
            tensors.update(load_file(file))
        except Exception as exc:
            raise ModelLoadError(f"cannot read weights {file}: {_one_line(exc)}") from exc
    model = LlamaModel(config, dtype=dtype)
    try:
        model.load_state(tensors)
    except ValueError as exc:
        raise ModelLoadError(f"weights in {model_dir} do not fit the config: {_one_line(exc)}") from exc
    return model.eval().requires_grad_(False), config


def configure_cpu_threads() -> None:
    """Cap torch's intra-op threads at the CPUs this process may use, unless the user chose a count."""
    if any(os.environ.get(var) for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "ORBITFLOW_NUM_THREADS")):
        if threads := os.environ.get("ORBITFLOW_NUM_THREADS"):
            if not threads.strip().isdigit() or int(threads) < 1:
                raise ModelLoadError(f"ORBITFLOW_NUM_THREADS must be an integer >= 1 (torch's intra-op threads), "
                                     f"got {threads!r}")
            torch.set_num_threads(int(threads))
        return
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if torch.get_num_threads() > available:
        torch.set_num_threads(available)


def _model_dir_for(path: Path) -> Path:
    if path.is_dir():
        return path
    if path.suffix.lower() == ".gguf":
        return ensure_converted(path)
    raise ModelLoadError(f"unsupported model file (expected a .gguf file or an HF directory): {path}")


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except Exception as exc:
            raise ModelLoadError(f"bad safetensors index {index}: {_one_line(exc)}") from exc
        return [model_dir / name for name in dict.fromkeys(weight_map.values())]
    single = model_dir / "model.safetensors"
    files = [single] if single.exists() else sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no .safetensors weights in {model_dir}")
    return files


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
