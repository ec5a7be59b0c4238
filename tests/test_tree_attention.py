"""The tree attention kernel (pallas_kernels/tree_attention.py) in Pallas interpret mode on fresh
random trees: each node's row equals, bit for bit, the AR step that decodes the same token with
its path at contiguous slots; equal to its reference within bf16 rounding; stale slots ignored."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.decode_attention import AttentionConfig, decode_attention
from pallas_kernels.tree_attention import path_slots, tree_attention, tree_attention_reference
from specjax.models.transformer import causal_slot_mask
from specjax.trees.tree import Tree

CFG = AttentionConfig(block_s=16, split_s=32)  # several blocks and splits per row


def f32(x):
    return np.asarray(jnp.asarray(x, jnp.float32))


def random_tree(rng, b, n):
    parents = np.full((b, n), -1, np.int32)
    for i in range(1, n):
        parents[:, i] = rng.integers(0, i, b)
    return Tree(tokens=jnp.zeros((b, n), jnp.int32), parents=jnp.asarray(parents), max_depth=n - 1)


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), groups=st.sampled_from([1, 3, 4]), hkv=st.sampled_from([1, 2]),
       n=st.integers(1, 9), b=st.integers(1, 2))
def test_each_node_rounds_as_the_ar_step_of_its_token(seed, groups, hkv, n, b):
    rng = np.random.default_rng(seed)
    s, hd = 96, 16
    k = jnp.asarray(rng.normal(0, 1, (b, s, hkv, hd)), jnp.bfloat16)
    v = jnp.asarray(rng.normal(0, 1, (b, s, hkv, hd)), jnp.bfloat16)
    start = jnp.asarray(rng.integers(0, s - n, b), jnp.int32)
    tree = random_tree(rng, b, n)
    anc = tree.ancestors()
    depths = tree.depths(anc)
    q = jnp.asarray(rng.normal(0, 1, (b, n, hkv * groups, hd)), jnp.bfloat16)
    y = tree_attention(q, k, v, start, anc, depths, n - 1, CFG, interpret=True)
    ref = tree_attention_reference(q, k, v, start, anc, depths, n - 1)
    np.testing.assert_allclose(f32(y), f32(ref), atol=2e-2, rtol=2e-2)
    paths = np.asarray(path_slots(anc, depths, start, n - 1))
    for r in range(b):
        for i in range(n):
            d = int(depths[r, i])
            # AR's cache: the same prefix, the node's path at start .. start + d, stale slots after
            ks, vs = np.array(f32(k[r:r + 1])), np.array(f32(v[r:r + 1]))
            ks[0, int(start[r]):int(start[r]) + d + 1] = f32(k[r])[paths[r, i, :d + 1]]
            vs[0, int(start[r]):int(start[r]) + d + 1] = f32(v[r])[paths[r, i, :d + 1]]
            pos = start[r:r + 1] + d
            ar = decode_attention(q[r:r + 1, i:i + 1], jnp.asarray(ks, jnp.bfloat16), jnp.asarray(vs, jnp.bfloat16),
                                  causal_slot_mask(pos, 1, s), pos + 1, CFG, interpret=True)
            np.testing.assert_array_equal(f32(ar)[0, 0], f32(y)[r, i], err_msg=f"row {r} node {i}")


def test_a_chain_is_plain_causal_attention_and_stale_slots_are_ignored():
    rng = np.random.default_rng(5)
    b, s, n, hkv, g, hd = 1, 80, 5, 2, 2, 16
    k = jnp.asarray(rng.normal(0, 1, (b, s, hkv, hd)), jnp.bfloat16)
    v = jnp.asarray(rng.normal(0, 1, (b, s, hkv, hd)), jnp.bfloat16)
    start = jnp.array([30], jnp.int32)
    chain = Tree(tokens=jnp.zeros((b, n), jnp.int32), parents=jnp.arange(-1, n - 1, dtype=jnp.int32)[None],
                 max_depth=n - 1)
    anc = chain.ancestors()
    q = jnp.asarray(rng.normal(0, 1, (b, n, hkv * g, hd)), jnp.bfloat16)
    y = tree_attention(q, k, v, start, anc, chain.depths(anc), n - 1, CFG, interpret=True)
    plain = decode_attention(q, k, v, causal_slot_mask(start, n, s), start + n, CFG, interpret=True)
    np.testing.assert_array_equal(f32(y), f32(plain))
    noisy = v.at[:, 35:].set(1e4)
    np.testing.assert_array_equal(
        f32(tree_attention(q, k, noisy, start, anc, chain.depths(anc), n - 1, CFG, interpret=True)), f32(y))


def test_bad_shapes_are_refused():
    q = jnp.ones((1, 3, 4, 16), jnp.bfloat16)
    kv = jnp.ones((1, 64, 2, 16), jnp.bfloat16)
    anc = jnp.ones((1, 3, 3), bool)
    with pytest.raises(ValueError, match="ancestors"):
        tree_attention(q, kv, kv, jnp.zeros(1, jnp.int32), anc[:, :2], jnp.zeros((1, 3), jnp.int32), 2,
                       interpret=True)


def test_the_dense_tree_mask_rounds_differently_from_ar():
    """Why the kernel exists: under the dense tree mask `decode_attention` pairs a node's terms by
    node slot, and on some of these trees its rows differ from the gathered (AR) layout's."""
    from specjax.trees.verify import tree_mask
    differ = 0
    for seed in range(12):
        rng = np.random.default_rng(seed)
        b, s, n, hkv, g, hd = 1, 96, 8, 2, 3, 16
        k = jnp.asarray(rng.normal(0, 1, (b, s, hkv, hd)), jnp.bfloat16)
        v = jnp.asarray(rng.normal(0, 1, (b, s, hkv, hd)), jnp.bfloat16)
        start = jnp.asarray(rng.integers(0, s - n, b), jnp.int32)
        tree = random_tree(rng, b, n)
        anc = tree.ancestors()
        q = jnp.asarray(rng.normal(0, 1, (b, n, hkv * g, hd)), jnp.bfloat16)
        y = tree_attention(q, k, v, start, anc, tree.depths(anc), n - 1, CFG, interpret=True)
        old = decode_attention(q, k, v, tree_mask(tree, start, s, anc), start + n, CFG, interpret=True)
        differ += int(not np.array_equal(f32(y), f32(old)))
    assert differ > 0
