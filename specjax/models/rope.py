"""Rotary position embedding (HF "rotate half" layout) with linear and Llama-3 frequency scaling."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models.config import ModelConfig
from specjax.rounding import round_like


def inverse_frequencies(cfg: ModelConfig) -> np.ndarray:
    """[head_dim // 2] float32 inverse frequencies, computed once on the host."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    s = cfg.rope_scaling
    if s is None:
        pass
    elif s.kind == "linear":
        inv = inv / s.factor
    elif s.kind == "llama3":
        low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
        high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
        smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor)
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    else:  # config.py refuses other kinds; this guards direct construction
        raise ValueError(f"unknown rope scaling kind {s.kind!r}")
    return inv.astype(np.float32)


def rope_cos_sin(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """positions [B, T] int -> cos, sin [B, T, head_dim] float32."""
    inv = jnp.asarray(inverse_frequencies(cfg))
    angles = positions.astype(jnp.float32)[..., None] * inv  # [B, T, hd/2]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, H, hd]; cos/sin [B, T, hd].

    A 16-bit x meets cos and sin rounded to its own dtype (as transformers casts them), so each
    product of two 16-bit values is exact in float32 and x cos + r sin rounds once, however a
    compiler evaluates it. With float32 cos and sin the products round, and whether XLA contracts
    the sum into an FMA, and which product it fuses, depends on how each program fuses RoPE (cos
    and sin inline or hoisted as constants): the serving engine's admission and the Decoder's
    prompt program gave one q element other bits that way, near a rounding tie, and the served
    tokens parted from AR's at near-ties (2026-12-07, found on the CPU with SmolLM2's dims)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    f32 = jnp.float32
    cos, sin, xf, rf = cos.astype(f32), sin.astype(f32), x.astype(f32), rotated.astype(f32)
    if jnp.dtype(x.dtype).itemsize == 2:
        # Not cos.astype(x.dtype).astype(f32): XLA's GPU pipeline may drop that convert pair in
        # one program and keep it in another (specjax/rounding.py; 2026-12-08, H100). x is
        # rounded again for the same reason: its producer's rounding may have been dropped.
        cos, sin = round_like(cos, x.dtype), round_like(sin, x.dtype)
        xf, rf = round_like(xf, x.dtype), round_like(rf, x.dtype)
    out = xf * cos[:, :, None, :] + rf * sin[:, :, None, :]
    return out.astype(x.dtype)
