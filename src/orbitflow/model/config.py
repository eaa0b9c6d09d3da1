"""Architecture hyper-parameters of a Llama-family decoder, read from a Hugging Face config.json."""

from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral")

_ARCHITECTURE_BY_CLASS = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama" | "qwen2" | "mistral"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # None for plain RoPE, else HF's dict with a "rope_type" key (e.g. "llama3")
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections (always on for Qwen2)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def o_proj_bias(self) -> bool:
        # Llama's `attention_bias` also covers o_proj; Qwen2 has bias on q/k/v only.
        return self.attention_bias and self.architecture == "llama"

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelConfig":
        architecture = _architecture_of(cfg)
        num_heads = int(cfg["num_attention_heads"])
        hidden_size = int(cfg["hidden_size"])
        rope_theta, rope_scaling = _rope_of(cfg)
        if architecture == "qwen2":
            attention_bias = True
        else:
            attention_bias = bool(cfg.get("attention_bias", False))
        if cfg.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg.get('hidden_act')!r}")
        return cls(
            architecture=architecture,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden_size // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_as_id_tuple(cfg.get("eos_token_id")),
        )

    def kv_bytes_per_token_per_layer(self, dtype_bytes: int = 4) -> int:
        return 2 * self.num_kv_heads * self.head_dim * dtype_bytes


def _architecture_of(cfg: dict[str, Any]) -> str:
    model_type = cfg.get("model_type")
    if model_type in SUPPORTED_ARCHITECTURES:
        return model_type
    for class_name in cfg.get("architectures") or ():
        if class_name in _ARCHITECTURE_BY_CLASS:
            return _ARCHITECTURE_BY_CLASS[class_name]
    raise ValueError(
        f"unsupported architecture (model_type={model_type!r}, architectures={cfg.get('architectures')})"
    )


def _rope_of(cfg: dict[str, Any]) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either the transformers<5 keys or the newer `rope_parameters` dict."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_theta = float(params.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type == "default":
        return rope_theta, None
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    return rope_theta, {"rope_type": rope_type, **params}


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
