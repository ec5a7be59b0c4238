"""The ragged paged attention kernel (Pallas interpret mode on the CPU) equals its plain-JAX
reference on fresh random inputs: ragged rows, shuffled block tables, reused pages holding NaN past
a row's live positions, GQA, float32 and bfloat16; and bad shapes are refused by name."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import PagedAttentionConfig, paged_attention, paged_attention_reference


def ragged_case(seed: int, dtype, R=3, W=5, Hq=4, Hkv=2, hd=16, page_size=16, max_pages=5):
    rng = np.random.default_rng(seed)
    num_pages = 1 + R * max_pages + 3
    k_pool = rng.normal(size=(num_pages, page_size, Hkv, hd)).astype(np.float32)
    v_pool = rng.normal(size=(num_pages, page_size, Hkv, hd)).astype(np.float32)
    pages = rng.permutation(np.arange(1, num_pages))[:R * max_pages].reshape(R, max_pages).astype(np.int32)
    kv_len = rng.integers(1, max_pages * page_size + 1, size=R).astype(np.int32)
    qpos = np.full((R, W), -1, np.int32)
    for r in range(R):  # a ragged number of new tokens ending at the row's last live position
        n = int(rng.integers(1, min(W, kv_len[r]) + 1))
        qpos[r, :n] = np.arange(kv_len[r] - n, kv_len[r])
        live_end = kv_len[r]
        for j in range(max_pages):  # past the row's live positions a reused page holds garbage
            lo = j * page_size
            if lo + page_size > live_end:
                cut = max(live_end - lo, 0)
                v_pool[pages[r, j], cut:] = np.nan
                k_pool[pages[r, j], cut:] = 1e4
    q = rng.normal(size=(R, W, Hq, hd)).astype(np.float32)
    cast = lambda x: jnp.asarray(x, dtype)
    return cast(q), cast(k_pool), cast(v_pool), jnp.asarray(pages), jnp.asarray(qpos), jnp.asarray(kv_len)


@pytest.mark.parametrize("seed,dtype,block_s,split_s", [(0, jnp.float32, 16, 32), (1, jnp.float32, 64, 256),
                                                        (2, jnp.bfloat16, 32, 96)])
def test_kernel_equals_reference(seed, dtype, block_s, split_s):
    q, k, v, pages, qpos, kv_len = ragged_case(seed, dtype)
    got = paged_attention(q, k, v, pages, qpos, kv_len, PagedAttentionConfig(block_s=block_s, split_s=split_s),
                          interpret=True)
    want = paged_attention_reference(q, k, v, pages, qpos, kv_len)
    real = np.asarray(qpos >= 0)
    got, want = np.asarray(got, np.float32)[real], np.asarray(want, np.float32)[real]
    assert np.isfinite(got).all()
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("seed,nodes", [(10, 5), (11, 40)])
def test_tree_masks_inside_segments_equal_reference(seed, nodes):
    """Tree verification: each row's columns are nodes of a random tree rooted at root[r]; a node
    sees the positions before the root and its ancestors' (words of 32 bits: 40 nodes use both)."""
    from specjax.trees.tree import Tree
    rng = np.random.default_rng(seed)
    R, Hq, Hkv, hd, page_size, max_pages = 3, 4, 2, 16, 16, 6
    num_pages = 1 + R * max_pages
    k = jnp.asarray(rng.normal(size=(num_pages, page_size, Hkv, hd)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(num_pages, page_size, Hkv, hd)), jnp.float32)
    pages = jnp.asarray(rng.permutation(np.arange(1, num_pages)).reshape(R, max_pages), jnp.int32)
    q = jnp.asarray(rng.normal(size=(R, nodes, Hq, hd)), jnp.float32)
    parents = np.array([[-1] + [int(rng.integers(0, j)) for j in range(1, nodes)] for _ in range(R)], np.int32)
    tree = Tree(jnp.zeros((R, nodes), jnp.int32), jnp.asarray(parents), nodes - 1)
    anc = tree.ancestors()
    root = jnp.asarray(rng.integers(0, max_pages * page_size - nodes, R), jnp.int32)
    n = rng.integers(1, nodes + 1, R)  # a ragged number of verified nodes per row
    qpos = jnp.asarray(np.where(np.arange(nodes)[None, :] < n[:, None], np.asarray(root)[:, None]
                                + np.arange(nodes)[None, :], -1), jnp.int32)
    kv_len = root + jnp.asarray(n, jnp.int32)
    got = paged_attention(q, k, v, pages, qpos, kv_len, PagedAttentionConfig(block_s=16, split_s=32), interpret=True,
                          root=root, ancestors=anc)
    want = paged_attention_reference(q, k, v, pages, qpos, kv_len, root=root, ancestors=anc)
    real = np.asarray(qpos >= 0)
    assert np.isfinite(np.asarray(got)[real]).all()
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], rtol=1e-5, atol=1e-5)
    # a node's result is not the plain causal one (the tree mask took effect)
    causal = paged_attention_reference(q, k, v, pages, qpos, kv_len)
    assert not np.allclose(np.asarray(causal)[real], np.asarray(want)[real], atol=1e-3)
    # a chain written as a tree is the chain
    chain = jnp.broadcast_to(jnp.tril(jnp.ones((nodes, nodes), bool)), (R, nodes, nodes))
    np.testing.assert_array_equal(
        np.asarray(paged_attention(q, k, v, pages, qpos, kv_len, interpret=True, root=root, ancestors=chain))[real],
        np.asarray(paged_attention(q, k, v, pages, qpos, kv_len, interpret=True))[real])


@pytest.mark.parametrize("seed,dtype,page_size", [(30, jnp.bfloat16, 16), (31, jnp.float32, 8), (32, jnp.bfloat16, 32)])
def test_kernel_rounds_as_decode_attention_over_the_gathered_view(seed, dtype, page_size):
    """A served token's attention, read through the block table, equals bit for bit what the
    engine's AR step computes with `decode_attention` over a dense cache holding the same
    positions (blocks of 64 spanning pages, splits of 256, the same per-block arithmetic), so
    served tokens pass the forcing gate against that AR on a GPU too. A page-at-a-time online
    softmax (the kernel before 2026-12-07) rounds differently."""
    from pallas_kernels.decode_attention import decode_attention
    q, k, v, pages, qpos, kv_len = ragged_case(seed, dtype, R=4, W=3, Hq=6, Hkv=2, hd=32, page_size=page_size,
                                               max_pages=640 // page_size)
    got = paged_attention(q, k, v, pages, qpos, kv_len, interpret=True)
    R, P = pages.shape
    view = lambda pool: pool[pages].reshape((R, P * page_size) + pool.shape[2:])
    pos = jnp.arange(P * page_size)
    live = pos[None, :] < kv_len[:, None]
    v_view = jnp.where(live[:, :, None, None], view(v), 0)  # as the serving engine's view path
    mask = (pos[None, None, :] <= qpos[:, :, None]) & live[:, None, :]
    want = decode_attention(q, view(k), v_view, mask, kv_len, interpret=True)
    real = np.asarray(qpos >= 0)
    assert real.sum() > R and int(kv_len.max()) > 256  # several tokens, more than one split
    np.testing.assert_array_equal(np.asarray(got, np.float32)[real], np.asarray(want, np.float32)[real])


@pytest.mark.parametrize("seed,dtype,page_size", [(40, jnp.float32, 8), (41, jnp.bfloat16, 16)])
def test_masked_form_rounds_as_decode_attention_with_that_mask(seed, dtype, page_size):
    """The hybrid target's form: a dense mask as its forward builds one (a deferred path's causal
    rows ahead of a random tree's nodes) equals `decode_attention` with that mask over the gathered
    view, bit for bit; and `mask_rules` gives back exactly the mask's visible positions."""
    from pallas_kernels.decode_attention import decode_attention
    from pallas_kernels.paged_attention import mask_rules, paged_attention_masked
    from specjax.trees.tree import Tree
    rng = np.random.default_rng(seed)
    R, D, N, Hq, Hkv, hd, P = 3, 3, 9, 4, 2, 16, 320 // page_size
    S = P * page_size
    root = rng.integers(D, S - N, R)
    pages = rng.permutation(np.arange(1, 1 + R * P)).reshape(R, P).astype(np.int32)
    k, v = (rng.normal(size=(1 + R * P, page_size, Hkv, hd)).astype(np.float32) for _ in range(2))
    for r in range(R):  # past a row's live positions a reused page holds garbage
        dead = np.arange(S) >= root[r] + N
        v.reshape(-1, Hkv, hd)[(pages[r][:, None] * page_size + np.arange(page_size)).reshape(-1)[dead]] = np.nan
    q = jnp.asarray(rng.normal(size=(R, D + N, Hq, hd)), dtype)
    k, v, pages = jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(pages)
    parents = np.array([[-1] + [int(rng.integers(0, j)) for j in range(1, N)] for _ in range(R)], np.int32)
    anc = np.asarray(Tree(jnp.zeros((R, N), jnp.int32), jnp.asarray(parents), N - 1).ancestors())
    pos = np.arange(S)
    mask = np.zeros((R, D + N, S), bool)
    for r in range(R):
        for d in range(D):  # the deferred path: positions root - D .. root - 1, causal
            mask[r, d] = pos <= root[r] - D + d
        rel = pos - root[r]
        for j in range(N):
            mask[r, D + j] = (rel < 0) | ((rel >= 0) & (rel < N) & anc[r, j, np.clip(rel, 0, N - 1)])
    kv_len = jnp.asarray(root + N, jnp.int32)
    mask = jnp.asarray(mask)
    k_view = k[pages].reshape((R, S) + k.shape[2:])
    v_view = jnp.where((pos[None, :] < kv_len[:, None])[:, :, None, None], v[pages].reshape((R, S) + v.shape[2:]), 0)
    limit, bits = mask_rules(mask)
    rel = pos[None, None, :] - limit[..., None]
    word = jnp.where(rel < 32, bits[:, 0, :, None], bits[:, 1, :, None])
    ruled = (rel < 0) | ((rel < 64) & (((word >> jnp.clip(rel & 31, 0, 31)) & 1) == 1))
    np.testing.assert_array_equal(np.asarray(ruled), np.asarray(mask))
    got = paged_attention_masked(q, k, v, pages, mask, kv_len, interpret=True)
    want = decode_attention(q, k_view, v_view, mask, kv_len, interpret=True)
    assert np.isfinite(np.asarray(got, np.float32)).all()
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_a_rows_result_does_not_depend_on_the_other_rows_or_the_width():
    q, k, v, pages, qpos, kv_len = ragged_case(4, jnp.float32)
    full = paged_attention(q, k, v, pages, qpos, kv_len, interpret=True)
    alone = paged_attention(q[1:2, :2], k, v, pages[1:2], qpos[1:2, :2], kv_len[1:2], interpret=True)
    keep = np.asarray(qpos[1, :2] >= 0)
    np.testing.assert_array_equal(np.asarray(full[1, :2])[keep], np.asarray(alone[0])[keep])


def test_a_row_without_live_positions_gives_zeros():
    """A block-table row with no token this step (kv_len 0) reads nothing and returns zeros, while
    a NaN from a failed request inside a row's live positions still shows."""
    q, k, v, pages, qpos, kv_len = ragged_case(6, jnp.float32)
    kv_len = kv_len.at[0].set(0)
    qpos = qpos.at[0].set(-1)
    out = paged_attention(q, k, v, pages, qpos, kv_len, interpret=True)
    assert np.all(np.asarray(out[0]) == 0)
    poisoned = v.at[pages[1, 0], 0].set(jnp.nan)  # position 0 of row 1: live, visible to its tokens
    out = paged_attention(q, k, poisoned, pages, qpos, kv_len, interpret=True)
    assert np.isnan(np.asarray(out[1])[np.asarray(qpos[1] >= 0)]).all()


def test_bad_shapes_are_refused():
    q, k, v, pages, qpos, kv_len = ragged_case(5, jnp.float32)
    with pytest.raises(ValueError, match="page_size must be a power of two"):
        paged_attention(q, k[:, :12], v[:, :12], pages, qpos, kv_len, interpret=True)
    with pytest.raises(ValueError, match="block table"):
        paged_attention(q, k, v, pages[:2], qpos, kv_len, interpret=True)
