"""Llama-family causal LM (Llama 3, Qwen2, Mistral, SmolLM2) over a packed batch of tokens.

All sequences' tokens are concatenated into one [T, hidden] batch for the matmuls; only attention is
per-sequence, delegated to an `AttentionBackend`. Operation order mirrors transformers, so float32 results
match it to rounding (decode attention takes its own kernel path, `attention.decode_attention`, and may differ
in the last bits); greedy tokens are the same. q/k/v and gate/up projections are fused into single matmuls
(each output column is the same dot product, so the numerics do not change).
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from orbitflow.model.attention import AttentionBackend
from orbitflow.model.config import ModelConfig
from orbitflow.model.norm import RMSNorm
from orbitflow.model.rotary import RotaryEmbedding, apply_rotary


class _UninitializedLinear(nn.Linear):
    def reset_parameters(self) -> None:
        pass  # weights come from load_state; skipping the random init saves seconds on load


class _UninitializedEmbedding(nn.Embedding):
    def reset_parameters(self) -> None:
        pass


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = _UninitializedLinear(
            config.hidden_size, self.q_size + 2 * self.kv_size, config.attention_bias
        )
        self.o_proj = _UninitializedLinear(self.q_size, config.hidden_size, config.o_proj_bias)

    def forward(self, layer: int, x: Tensor, cos: Tensor, sin: Tensor, attention: AttentionBackend) -> Tensor:
        tokens = x.shape[0]
        qk, v = self.qkv_proj(x).split((self.q_size + self.kv_size, self.kv_size), dim=-1)
        # RoPE over q's and k's heads in one go (elementwise, so each value is what two calls would give)
        qk = apply_rotary(qk.view(tokens, self.num_heads + self.num_kv_heads, self.head_dim), cos, sin)
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        return self.o_proj(attention(layer, q, k, v))


class SwiGLUMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = _UninitializedLinear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = _UninitializedLinear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLUMLP(config)

    def forward(self, layer: int, x: Tensor, cos: Tensor, sin: Tensor, attention: AttentionBackend) -> Tensor:
        x = x + self.self_attn(layer, self.input_layernorm(x), cos, sin, attention)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """The whole causal LM. Build, then `load_state` with HF-named weights before use."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.embed_tokens = _UninitializedEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else _UninitializedLinear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.rotary = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings
        )

    def forward(self, input_ids: Tensor, positions: Tensor, attention: AttentionBackend) -> Tensor:
        """input_ids, positions: [T] (packed batch) -> final-normed hidden states [T, hidden]."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, head_dim]: once, not twice a layer
        for index, layer in enumerate(self.layers):
            x = layer(index, x, cos, sin, attention)
        return self.norm(x)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """[N, hidden] -> [N, vocab] float32."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def load_state(self, tensors: dict[str, Tensor]) -> None:
        """Load HF-named weights ("model.layers.0.self_attn.q_proj.weight", ...), fusing q/k/v and gate/up.

        Raises ValueError on missing, unexpected or mis-shaped tensors.
        """
        remaining = {name: t for name, t in tensors.items() if not name.endswith("rotary_emb.inv_freq")}

        def take(name: str) -> Tensor:
            if name not in remaining:
                raise ValueError(f"missing weight {name!r}")
            return remaining.pop(name)

        def assign(module: nn.Module, attr: str, value: Tensor) -> None:
            expected = getattr(module, attr).shape
            if value.shape != expected:
                raise ValueError(
                    f"weight for {attr} has shape {tuple(value.shape)}, expected {tuple(expected)}"
                )
            param = nn.Parameter(value.to(self.dtype).contiguous(), requires_grad=False)
            setattr(module, attr, param)

        config = self.config
        assign(self.embed_tokens, "weight", take("model.embed_tokens.weight"))
        assign(self.norm, "weight", take("model.norm.weight"))
        for index, layer in enumerate(self.layers):
            prefix = f"model.layers.{index}."
            attn = layer.self_attn
            qkv = [take(f"{prefix}self_attn.{p}_proj.weight") for p in "qkv"]
            assign(attn.qkv_proj, "weight", torch.cat(qkv))
            if config.attention_bias:
                assign(
                    attn.qkv_proj,
                    "bias",
                    torch.cat([take(f"{prefix}self_attn.{p}_proj.bias") for p in "qkv"]),
                )
            assign(attn.o_proj, "weight", take(f"{prefix}self_attn.o_proj.weight"))
            if config.o_proj_bias:
                assign(attn.o_proj, "bias", take(f"{prefix}self_attn.o_proj.bias"))
            gate_up = [take(f"{prefix}mlp.{p}_proj.weight") for p in ("gate", "up")]
            assign(layer.mlp.gate_up_proj, "weight", torch.cat(gate_up))
            assign(layer.mlp.down_proj, "weight", take(f"{prefix}mlp.down_proj.weight"))
            assign(layer.input_layernorm, "weight", take(f"{prefix}input_layernorm.weight"))
            assign(layer.post_attention_layernorm, "weight", take(f"{prefix}post_attention_layernorm.weight"))
        if self.lm_head is not None:
            assign(self.lm_head, "weight", take("lm_head.weight"))
        else:
            remaining.pop("lm_head.weight", None)  # some tied checkpoints store a copy
        if remaining:
            raise ValueError(f"unexpected weights: {sorted(remaining)[:5]}")
        self.rotary.to(self.embed_tokens.weight.device)
