"""One-time conversion of a GGUF file into a cached Hugging Face directory (float32 safetensors + tokenizer).

transformers dequantises the tensors (through the `gguf` package) and undoes llama.cpp's q/k row
permutation; later loads read the cached directory without importing transformers.
"""

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path

from orbitflow.model.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"


def is_gguf_file(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def cache_root() -> Path:
    return Path(os.environ.get("ORBITFLOW_CACHE") or Path.home() / ".cache" / "orbitflow" / "models")


def converted_dir_for(gguf_path: Path) -> Path:
    """<cache>/<stem>-<hash of size and mtime>: a replaced file gets a fresh conversion."""
    stat = gguf_path.stat()
    digest = hashlib.sha256(f"{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_root() / f"{gguf_path.stem}-{digest}"


def is_converted(model_dir: Path) -> bool:
    return (model_dir / "config.json").exists() and (model_dir / "model.safetensors").exists()


def ensure_converted(gguf_path: Path) -> Path:
    """The cached HF directory for a GGUF file, converting it on first use."""
    if not is_gguf_file(gguf_path):
        raise ModelLoadError(f"not a GGUF file (bad magic): {gguf_path}")
    target = converted_dir_for(gguf_path)
    if not is_converted(target):
        convert_gguf(gguf_path, target)
    return target


def convert_gguf(gguf_path: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        _write_hf_dir(gguf_path, tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not is_converted(target):  # not merely lost a race to a concurrent conversion
                raise
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"cannot convert GGUF file {gguf_path}: {_one_line(exc)}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_hf_dir(gguf_path: Path, out_dir: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source_dir, file_name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(source_dir, gguf_file=file_name)
    model = AutoModelForCausalLM.from_pretrained(source_dir, gguf_file=file_name, dtype=torch.float32)

    out_dir.mkdir(parents=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the saved weights are plain float32
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True), encoding="utf-8")

    state = model.state_dict()
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)  # shared with embed_tokens; safetensors refuses aliased tensors
    save_file(
        {name: t.contiguous() for name, t in state.items()}, out_dir / "model.safetensors", {"format": "pt"}
    )
    tokenizer.save_pretrained(out_dir)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
