"""Explicit model configuration for the dense decoder family (Llama, SmolLM2, Qwen3).

A `ModelConfig` is static (hashable) so it can be a `jit` static argument and a pytree meta field.
`from_hf_dict` reads a transformers `config.json` (both the older `rope_theta`/`rope_scaling` keys and
the newer `rope_parameters` block) and refuses anything this decoder would compute differently.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from specjax.errors import ConfigError, ModelFormatError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. kind: 'linear' or 'llama3' (the Llama-3.1 long-context rule)."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    attention_bias: bool = False  # bias on q/k/v/o projections
    dtype: str = "float32"  # parameter and activation dtype: float32 or bfloat16

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model config: {name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model config: num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"model config: head_dim must be even for RoPE, got {self.head_dim}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"model config: dtype must be float32 or bfloat16, got {self.dtype!r}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def with_layers(self, num_layers: int) -> "ModelConfig":
        return dataclasses.replace(self, num_layers=num_layers)

    def with_dtype(self, dtype: str) -> "ModelConfig":
        return dataclasses.replace(self, dtype=dtype)


def _rope_from_hf(d: dict[str, Any], where: str) -> tuple[float, RopeScaling | None]:
    params = d.get("rope_parameters")
    if isinstance(params, dict):  # transformers >= 5 layout
        theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
        scaling = params
    else:
        theta = d.get("rope_theta", 10000.0)
        scaling = d.get("rope_scaling")
    if not scaling:
        return float(theta), None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind == "linear":
        return float(theta), RopeScaling("linear", float(scaling["factor"]))
    if kind == "llama3":
        return float(theta), RopeScaling(
            "llama3", float(scaling["factor"]), float(scaling["low_freq_factor"]),
            float(scaling["high_freq_factor"]), int(scaling["original_max_position_embeddings"]))
    raise ModelFormatError(f"{where}: rope scaling type {kind!r} is not supported "
                           "(supported: default, linear, llama3)")


def from_hf_dict(d: dict[str, Any], where: str = "config.json", dtype: str = "float32") -> ModelConfig:
    """Build a ModelConfig from a transformers config dict; `where` names the file in errors."""
    archs = d.get("architectures") or []
    model_type = d.get("model_type")
    if model_type not in ("llama", "qwen3") and not set(archs) & set(SUPPORTED_ARCHITECTURES):
        raise ModelFormatError(f"{where}: unsupported architecture {archs or model_type!r} "
                               f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    if d.get("mlp_bias"):
        raise ModelFormatError(f"{where}: mlp_bias=true is not supported")
    if d.get("hidden_act", "silu") != "silu":
        raise ModelFormatError(f"{where}: hidden_act {d.get('hidden_act')!r} is not supported (silu only)")
    try:
        num_heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        theta, scaling = _rope_from_hf(d, where)
        is_qwen3 = model_type == "qwen3" or "Qwen3ForCausalLM" in archs
        return ModelConfig(
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(d.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qk_norm=is_qwen3,
            attention_bias=bool(d.get("attention_bias", False)),
            dtype=dtype,
        )
    except KeyError as e:
        raise ModelFormatError(f"{where}: missing field {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ModelFormatError(f"{where}: bad value: {e}") from None
