"""Explicit configuration of the hybrid recurrent target (Qwen3-Next style): Gated DeltaNet layers
interleaved with gated full-attention layers, every layer followed by a dense SwiGLU MLP.

A `HybridConfig` is static (hashable) so it can be a `jit` static argument. `from_hf_dict` reads a
transformers `qwen3_next` config.json and refuses anything this model would compute differently,
notably mixture-of-experts MLP layers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from specjax.errors import ConfigError, ModelFormatError

LAYER_KINDS = ("linear_attention", "full_attention")


@dataclasses.dataclass(frozen=True)
class HybridConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    layer_types: tuple[str, ...]  # per layer: "linear_attention" (Gated DeltaNet) or "full_attention"
    # gated attention layers
    num_heads: int
    num_kv_heads: int
    head_dim: int
    partial_rotary_factor: float = 0.25  # RoPE rotates the first int(head_dim * factor) dims
    rope_theta: float = 10000.0
    # Gated DeltaNet layers
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    dtype: str = "float32"  # parameter and activation dtype: float32 or bfloat16

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
                     "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim"):
            if getattr(self, name) < 1:
                raise ConfigError(f"hybrid config: {name} must be >= 1, got {getattr(self, name)}")
        if not isinstance(self.layer_types, tuple):  # a list would make the config unhashable
            raise ConfigError(f"hybrid config: layer_types must be a tuple, "
                              f"got {type(self.layer_types).__name__}")
        if len(self.layer_types) != self.num_layers:
            raise ConfigError(f"hybrid config: layer_types has {len(self.layer_types)} entries, "
                              f"num_layers is {self.num_layers}")
        bad = sorted(set(self.layer_types) - set(LAYER_KINDS))
        if bad:
            raise ConfigError(f"hybrid config: layer_types has unknown kinds {bad} "
                              f"(known: {', '.join(LAYER_KINDS)})")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"hybrid config: num_heads ({self.num_heads}) must be a multiple of "
                              f"num_kv_heads ({self.num_kv_heads})")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(
                f"hybrid config: linear_num_value_heads ({self.linear_num_value_heads}) must be a "
                f"multiple of linear_num_key_heads ({self.linear_num_key_heads})")
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ConfigError(f"hybrid config: partial_rotary_factor must be in (0, 1], "
                              f"got {self.partial_rotary_factor}")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ConfigError(f"hybrid config: the rotary dims int(head_dim * partial_rotary_factor) = "
                              f"{self.rotary_dim} must be even and >= 2")
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"hybrid config: dtype must be float32 or bfloat16, got {self.dtype!r}")

    # gated attention
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)  # int() truncates, as transformers

    # Gated DeltaNet
    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: q, k (key heads) and v (value heads)."""
        return 2 * self.key_dim + self.value_dim

    @property
    def value_heads_per_key_head(self) -> int:
        return self.linear_num_value_heads // self.linear_num_key_heads

    @property
    def in_proj_size(self) -> int:
        """Columns of the fused GDN input projection: q, k, v, z, b, a."""
        return self.conv_dim + self.value_dim + 2 * self.linear_num_value_heads

    # layer kinds
    @property
    def gdn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def attn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    def with_dtype(self, dtype: str) -> "HybridConfig":
        return dataclasses.replace(self, dtype=dtype)


def _rope_from_hf(d: dict[str, Any], where: str) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) with transformers' precedence: the `rope_parameters`
    (or legacy `rope_scaling`) block first, then top-level keys, then Qwen3-Next's defaults."""
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ModelFormatError(f"{where}: rope_parameters must be an object, got {params!r}")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise ModelFormatError(f"{where}: rope_type {kind!r} is not supported (default only)")
    theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    factor = params.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25))
    return float(theta), float(factor)


def _layer_types_from_hf(d: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    types = d.get("layer_types")
    if types is not None:
        return tuple(types)
    interval = int(d.get("full_attention_interval", 4))  # transformers' rule when layer_types is absent
    return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention"
                 for i in range(num_layers))


def _check_dense_mlp(d: dict[str, Any], num_layers: int, where: str) -> None:
    """Every layer must get transformers' dense Qwen3NextMLP: layer i is a sparse MoE block unless
    i is in mlp_only_layers, or num_experts == 0, or (i + 1) % decoder_sparse_step != 0."""
    num_experts = int(d.get("num_experts", 512))
    if num_experts == 0:
        return
    step = int(d.get("decoder_sparse_step", 1))
    if step < 1:
        raise ModelFormatError(f"{where}: decoder_sparse_step must be >= 1, got {step}")
    dense_only = set(d.get("mlp_only_layers") or [])
    moe = [i for i in range(num_layers) if i not in dense_only and (i + 1) % step == 0]
    if moe:
        raise ModelFormatError(
            f"{where}: layers {moe} are mixture-of-experts (num_experts={num_experts}, "
            f"decoder_sparse_step={step}, mlp_only_layers={sorted(dense_only)}); MoE layers are not "
            "implemented: only configs whose every layer is a dense MLP (num_experts=0, or every "
            "layer in mlp_only_layers) are supported")


def from_hf_dict(d: dict[str, Any], where: str = "config.json", dtype: str = "float32") -> HybridConfig:
    """Build a HybridConfig from a transformers Qwen3-Next config dict; `where` names the file in
    errors. Missing optional fields take transformers' Qwen3NextConfig defaults."""
    archs = d.get("architectures") or []
    if d.get("model_type") != "qwen3_next" and "Qwen3NextForCausalLM" not in archs:
        raise ModelFormatError(f"{where}: unsupported architecture {archs or d.get('model_type')!r} "
                               "(supported: qwen3_next / Qwen3NextForCausalLM)")
    if d.get("hidden_act", "silu") != "silu":
        raise ModelFormatError(f"{where}: hidden_act {d.get('hidden_act')!r} is not supported (silu only)")
    if d.get("attention_bias"):
        raise ModelFormatError(f"{where}: attention_bias=true is not supported")
    try:
        num_layers = int(d["num_hidden_layers"])
        _check_dense_mlp(d, num_layers, where)
        theta, factor = _rope_from_hf(d, where)
        return HybridConfig(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_layers=num_layers,
            layer_types=_layer_types_from_hf(d, num_layers),
            num_heads=int(d["num_attention_heads"]),
            num_kv_heads=int(d.get("num_key_value_heads", 2)),
            head_dim=int(d.get("head_dim", 256)),
            partial_rotary_factor=factor,
            rope_theta=theta,
            linear_num_key_heads=int(d.get("linear_num_key_heads", 16)),
            linear_num_value_heads=int(d.get("linear_num_value_heads", 32)),
            linear_key_head_dim=int(d.get("linear_key_head_dim", 128)),
            linear_value_head_dim=int(d.get("linear_value_head_dim", 128)),
            linear_conv_kernel_dim=int(d.get("linear_conv_kernel_dim", 4)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
            dtype=dtype,
        )
    except KeyError as e:
        raise ModelFormatError(f"{where}: missing field {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ModelFormatError(f"{where}: bad value: {e}") from None
    except ConfigError as e:
        raise ModelFormatError(f"{where}: {e}") from None
