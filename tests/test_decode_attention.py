"""The fused attention kernel (pallas_kernels/decode_attention.py) in Pallas interpret mode, on
fresh random shapes: equal to its reference within bf16 rounding, a row's result independent of T
(AR and verify steps agree bit for bit), tree masks, and caches whose slots are no multiple of
the block."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.decode_attention import (AttentionConfig, decode_attention,
                                             decode_attention_reference)
from specjax.models.transformer import causal_slot_mask

CFG = AttentionConfig(block_s=16, split_s=32)  # small blocks: several blocks and splits per row


def caches(rng, b, s, hkv, hd):
    k = jnp.asarray(rng.normal(0, 1, (b, s, hkv, hd)), jnp.bfloat16)
    v = jnp.asarray(rng.normal(0, 1, (b, s, hkv, hd)), jnp.bfloat16)
    return k, v


def f32(x):
    return np.asarray(jnp.asarray(x, jnp.float32))


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), groups=st.sampled_from([1, 2, 4]), hkv=st.sampled_from([1, 2]),
       hd=st.sampled_from([16, 32]), t=st.integers(2, 9), b=st.integers(1, 2))
def test_matches_reference_and_rows_do_not_depend_on_t(seed, groups, hkv, hd, t, b):
    rng = np.random.default_rng(seed)
    s = 96
    kc, vc = caches(rng, b, s, hkv, hd)
    start = jnp.asarray(rng.integers(0, s - t, b), jnp.int32)
    q = jnp.asarray(rng.normal(0, 1, (b, t, hkv * groups, hd)), jnp.bfloat16)
    mask = causal_slot_mask(start, t, s)
    y = decode_attention(q, kc, vc, mask, start + t, CFG, interpret=True)
    ref = decode_attention_reference(q, kc, vc, mask)
    np.testing.assert_allclose(f32(y), f32(ref), atol=2e-2, rtol=2e-2)
    # the first j rows of a T-token call equal a j-token call's rows, bit for bit
    for j in (1, t - 1):
        yj = decode_attention(q[:, :j], kc, vc, causal_slot_mask(start, j, s), start + j, CFG, interpret=True)
        np.testing.assert_array_equal(f32(yj), f32(y[:, :j]))


def test_tree_mask_and_ragged_slots():
    """An arbitrary visibility mask (tree verification) over a cache of 72 slots (not a multiple
    of the 16-slot block: the padded path)."""
    rng = np.random.default_rng(7)
    b, s, t, hkv, groups, hd = 2, 72, 5, 2, 2, 16
    kc, vc = caches(rng, b, s, hkv, hd)
    start = jnp.array([40, 9], jnp.int32)
    mask = np.array(causal_slot_mask(start, t, s))
    mask &= rng.random(mask.shape) < 0.7
    mask[:, :, 0] = True  # every token sees the first prompt slot
    q = jnp.asarray(rng.normal(0, 1, (b, t, hkv * groups, hd)), jnp.bfloat16)
    y = decode_attention(q, kc, vc, jnp.asarray(mask), start + t, CFG, interpret=True)
    ref = decode_attention_reference(q, kc, vc, jnp.asarray(mask))
    np.testing.assert_allclose(f32(y), f32(ref), atol=2e-2, rtol=2e-2)


def test_stale_slots_past_the_mask_are_ignored():
    """Slots past a row's visible range hold stale values (rejected drafts): they must not leak."""
    rng = np.random.default_rng(3)
    kc, vc = caches(rng, 1, 64, 1, 16)
    start = jnp.array([20], jnp.int32)
    q = jnp.asarray(rng.normal(0, 1, (1, 3, 2, 16)), jnp.bfloat16)
    mask = causal_slot_mask(start, 3, 64)
    y = decode_attention(q, kc, vc, mask, start + 3, CFG, interpret=True)
    noisy = vc.at[:, 23:].set(1e4)
    np.testing.assert_array_equal(f32(decode_attention(q, kc, noisy, mask, start + 3, CFG, interpret=True)), f32(y))


def test_bad_shapes_and_configs_are_refused():
    with pytest.raises(ValueError, match="split_s"):
        AttentionConfig(block_s=64, split_s=96)
    with pytest.raises(ValueError, match="block_s"):
        AttentionConfig(block_s=48)
    kc = jnp.zeros((1, 32, 3, 16), jnp.bfloat16)
    with pytest.raises(ValueError, match="decode_attention"):
        decode_attention(jnp.zeros((1, 2, 4, 16), jnp.bfloat16), kc, kc, jnp.ones((1, 2, 32), bool),
                         jnp.array([2]), CFG, interpret=True)
