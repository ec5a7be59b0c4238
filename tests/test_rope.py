"""RoPE (specjax/models/rope.py): a 16-bit x is rotated with one rounding, whatever the compiler
does with the multiply-adds: the result equals the exact x cos + r sin (cos and sin at x's
precision) rounded once, so two programs that fuse RoPE differently (FMA contraction or not)
agree bit for bit. With float32 cos and sin the products round first, and an FMA would change
the bits near ties (the serving engine's admission and the Decoder's prompt program did, with
SmolLM2's dimensions)."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from conftest import tiny_config
from specjax.models.rope import apply_rope, rope_cos_sin


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_16bit_rope_rounds_once(dtype):
    cfg = tiny_config(head_dim=64, rope_theta=100000.0)
    rng = np.random.default_rng(0)
    B, T, H, hd = 2, 300, 3, 64
    positions = jnp.asarray(rng.integers(0, 8000, (B, T)), jnp.int32)
    x = jnp.asarray(rng.normal(0, 2, (B, T, H, hd)), dtype)
    cos, sin = rope_cos_sin(cfg, positions)
    got = np.asarray(apply_rope(x, cos, sin).astype(jnp.float32))
    # exact in float64: x and cos / sin at 16 bits, products exact, one rounding to float32, then x's dtype
    npd = ml_dtypes.bfloat16 if dtype == jnp.bfloat16 else np.float16
    xs = np.asarray(x.astype(jnp.float32), np.float64)
    c = np.asarray(cos, np.float32).astype(npd).astype(np.float64)[:, :, None, :]
    s = np.asarray(sin, np.float32).astype(npd).astype(np.float64)[:, :, None, :]
    rot = np.concatenate([-xs[..., hd // 2:], xs[..., :hd // 2]], axis=-1)
    want = (xs * c + rot * s).astype(np.float32).astype(npd).astype(np.float32)
    np.testing.assert_array_equal(got, want)


def test_float32_rope_keeps_float32_cos():
    cfg = tiny_config(head_dim=8)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(1, 5, 2, 8)), jnp.float32)
    cos, sin = rope_cos_sin(cfg, jnp.arange(5)[None] + 1000)
    out = apply_rope(x, cos, sin)
    rot = jnp.concatenate([-x[..., 4:], x[..., :4]], axis=-1)
    np.testing.assert_allclose(np.asarray(out), np.asarray(x * cos[:, :, None] + rot * sin[:, :, None]),
                               rtol=1e-6, atol=1e-6)
