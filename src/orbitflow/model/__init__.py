"""Llama-family model, weights/tokenizer loading and the attention-backend contract."""

from orbitflow.model.attention import AttentionBackend, DenseKVAttention, causal_attention
from orbitflow.model.config import ModelConfig
from orbitflow.model.errors import ModelLoadError
from orbitflow.model.generate import greedy_generate
from orbitflow.model.llama import LlamaModel
from orbitflow.model.loader import LoadedModel, load_model, load_weights
from orbitflow.model.registry import BUILTIN_MODELS, DEFAULT_MODEL, resolve_model_path
from orbitflow.model.tokenizer import IncrementalDecoder, Tokenizer

__all__ = [
    "AttentionBackend",
    "BUILTIN_MODELS",
    "DEFAULT_MODEL",
    "DenseKVAttention",
    "IncrementalDecoder",
    "LlamaModel",
    "LoadedModel",
    "ModelConfig",
    "ModelLoadError",
    "Tokenizer",
    "causal_attention",
    "greedy_generate",
    "load_model",
    "load_weights",
    "resolve_model_path",
]
