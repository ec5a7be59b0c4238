"""Gated DeltaNet over token trees: the parallel form (pure JAX and the Pallas kernel in interpret
mode) against the plain recurrence run node by node from each parent's state, on fresh random
trees and inputs; conv windows along paths. (The committed state: tests/test_hybrid_decoding.py.)"""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.tree_gdn import TreeGDNConfig, tree_gdn, tree_gdn_reference
from specjax.models.gdn_tree import gdn_tree_reference
from specjax.models.gdn_rule import gdn_scan, normalize_qk
from specjax.models.gdn_tree import commit_window, gdn_tree_parallel, inverse_unit_lower, path_windows
from specjax.trees.shape import TreeShape

TOL = dict(atol=2e-5, rtol=2e-5)  # float32: the parallel form sums in another order


def random_parents(rng, n):
    return (-1,) + tuple(int(rng.integers(0, i)) for i in range(1, n))


def inputs(rng, b, n, h, dk, dv):
    q, k = normalize_qk(jnp.asarray(rng.normal(size=(b, n, h, dk)), jnp.float32),
                        jnp.asarray(rng.normal(size=(b, n, h, dk)), jnp.float32))
    v = jnp.asarray(rng.normal(size=(b, n, h, dv)), jnp.float32)
    g = jnp.asarray(-rng.uniform(0.01, 1.5, (b, n, h)), jnp.float32)  # decay e^g in (0.2, 1)
    beta = jnp.asarray(rng.uniform(0, 1, (b, n, h)), jnp.float32)
    state = jnp.asarray(rng.normal(size=(b, h, dk, dv)), jnp.float32)
    return state, q, k, v, g, beta


def ancestors(parents, b):
    shape = TreeShape(parents)
    return jnp.broadcast_to(jnp.asarray(shape.ancestors), (b,) + shape.ancestors.shape), shape.max_depth


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 40), h=st.integers(1, 3),
       dk=st.sampled_from([8, 16]), dv=st.sampled_from([8, 32]))
def test_parallel_form_equals_node_by_node(seed, n, h, dk, dv):
    rng = np.random.default_rng(seed)
    parents = random_parents(rng, n)
    x = inputs(rng, 2, n, h, dk, dv)
    anc, depth = ancestors(parents, 2)
    ref = gdn_tree_reference(*x, parents)
    np.testing.assert_allclose(gdn_tree_parallel(*x, anc, depth), ref, **TOL)


@pytest.mark.parametrize("kind", ["chain", "siblings", "single", "random"])
def test_kernel_equals_node_by_node(kind):
    rng = np.random.default_rng({"chain": 1, "siblings": 2, "single": 3, "random": 4}[kind])
    n = {"chain": 20, "siblings": 9, "single": 1, "random": 33}[kind]
    parents = {"chain": TreeShape.chain(n - 1).parents, "siblings": (-1,) + (0,) * (n - 1),
               "single": (-1,), "random": random_parents(rng, n)}[kind]
    x = inputs(rng, 2, n, 2, 16, 32)
    anc, depth = ancestors(parents, 2)
    out = tree_gdn(*x, anc, depth, TreeGDNConfig(block_dv=16), interpret=True)
    np.testing.assert_allclose(out, tree_gdn_reference(*x, parents), **TOL)


def test_chain_equals_the_scan_and_rows_have_their_own_trees():
    rng = np.random.default_rng(5)
    n = 12
    x = inputs(rng, 2, n, 2, 8, 8)
    chain = TreeShape.chain(n - 1)
    out_scan, _ = gdn_scan(*x)
    anc, depth = ancestors(chain.parents, 2)
    np.testing.assert_allclose(gdn_tree_parallel(*x, anc, depth), out_scan, **TOL)
    # per-row trees: row 1 is all siblings
    sib = (-1,) + (0,) * (n - 1)
    anc2 = jnp.stack([jnp.asarray(chain.ancestors), jnp.asarray(TreeShape(sib).ancestors)])
    out = tree_gdn(*x, anc2, n - 1, interpret=True)
    ref1 = tree_gdn_reference(*(y[1:] for y in x), sib)
    np.testing.assert_allclose(out[1:], ref1, **TOL)
    np.testing.assert_allclose(out[:1], out_scan[:1], **TOL)


def test_inverse_by_squaring_is_the_inverse():
    rng = np.random.default_rng(6)
    parents = random_parents(rng, 30)
    anc, depth = ancestors(parents, 1)
    a = jnp.where(anc[0] & ~jnp.eye(30, dtype=bool), jnp.asarray(rng.normal(0, 0.5, (30, 30)), jnp.float32), 0)
    np.testing.assert_allclose(inverse_unit_lower(a, depth) @ (jnp.eye(30) + a), np.eye(30), atol=1e-4)


def test_conv_windows_follow_paths_and_commit():
    rng = np.random.default_rng(9)
    parents = (-1, 0, 1, 0, 3, 4, 1)
    b, n, c, k1 = 2, len(parents), 3, 3
    window = jnp.asarray(rng.normal(size=(b, k1, c)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(b, n, c)), jnp.float32)
    par = jnp.broadcast_to(jnp.asarray(parents), (b, n))
    wins = path_windows(window, x, par)
    for i in range(n):  # the plain sequence along node i's path: window, then root .. i
        chain, j = [], i
        while j >= 0:
            chain.insert(0, x[:, j])
            j = parents[j]
        seq = jnp.concatenate([window, jnp.stack(chain, 1)], axis=1)
        np.testing.assert_array_equal(wins[:, i], seq[:, -(k1 + 1):])
    path = jnp.array([[0, 3, 4, 5], [0, 1, 1, 1]], jnp.int32)
    new = commit_window(window, x, path, jnp.array([3, 0], jnp.int32))
    np.testing.assert_array_equal(new[0], x[0, jnp.array([3, 4, 5])])
    np.testing.assert_array_equal(new[1], jnp.concatenate([window[1, 1:], x[1, :1]]))
