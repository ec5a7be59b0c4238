"""Row packing (models/row_packing.py) and the packed hybrid verify forward it serves: the live
tokens of a padded layout go into the bucket in row order and come back where they were, and a
packed `hybrid_run` (deferred path + verify rows) gives the padded run's hidden states, GDN
states and K/V at every live row (to the last bits), on random configs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models.row_packing import pack_rows


def test_pack_rows_round_trip():
    rng = np.random.default_rng(0)
    live = rng.random((4, 6)) < 0.5
    live[2] = False  # a row with nothing live
    x = jnp.asarray(rng.normal(size=(4, 6, 3)), jnp.float32)
    n = int(live.sum())
    p = pack_rows(jnp.asarray(live), n + 3)
    flat = p.to_flat(x)
    assert flat.shape == (1, n + 3, 3)
    np.testing.assert_array_equal(np.asarray(flat[0, :n]), np.asarray(x)[live])  # row-major order
    back = np.asarray(p.to_rows(flat))
    np.testing.assert_array_equal(back[live], np.asarray(x)[live])
    for b in range(4):  # padding copies the row's first live token (a row without one: token 0)
        filler = np.asarray(x)[b][live[b]][0] if live[b].any() else np.asarray(flat[0, 0])
        np.testing.assert_array_equal(back[b][~live[b]], np.broadcast_to(filler, back[b][~live[b]].shape))


@pytest.mark.parametrize("seed", [21, 34])
def test_packed_hybrid_verify_equals_the_padded_one(seed):
    """A verify forward after a commit (so a deferred path replays first), run packed with
    per-row counts, matches the padded forward at every live row: hidden states, tapped features,
    every GDN state and window (a row with count 0 excepted: it runs nothing), and the K/V of the
    slots the live rows write."""
    from specjax.decoding.sequences import GenerationConfig, prefill
    from specjax.models.hybrid import init_random_hybrid_params
    from specjax.models.target import chain_verify, target_commit, with_replay_width
    from test_hybrid_decoding import hybrid_config
    cfg = hybrid_config(seed)
    params = init_random_hybrid_params(cfg, jax.random.PRNGKey(seed), scale=0.3)
    rng = np.random.default_rng(seed)
    B, W = 3, 5
    prompts = jnp.asarray(rng.integers(3, cfg.vocab_size, (B, 9)), jnp.int32)
    cache, seqs, _, _ = prefill(params, cfg, GenerationConfig(max_new_tokens=8), prompts,
                                jnp.array([9, 6, 8]), 48, jax.random.PRNGKey(0))
    cache = with_replay_width(params, cfg, cache, W)

    def tokens_at(pos):
        return jnp.asarray(rng.integers(3, cfg.vocab_size, (B, W)), jnp.int32), pos[:, None] + jnp.arange(W)[None]

    pos = seqs.length - 1
    tokens, positions = tokens_at(pos)
    _, _, verified, pending = chain_verify(params, cfg, tokens, positions, cache, pos, ())
    accepted = jnp.array([2, 4, 0])
    cache = target_commit(params, cfg, verified, pending, jnp.broadcast_to(jnp.arange(W), (B, W)), accepted, pos,
                          is_chain=True)
    pos = pos + accepted + 1
    tokens, positions = tokens_at(pos)
    taps = tuple(range(cfg.num_layers))
    counts = jnp.array([3, 5, 0], jnp.int32)
    run = jax.jit(lambda counts: chain_verify(params, cfg, tokens, positions, cache, pos, taps,
                                              None if counts is None else (counts, 8)))
    hid_p, feat_p, cache_p, _ = run(None)
    hid_k, feat_k, cache_k, _ = run(counts)
    live = np.arange(W)[None, :] < np.asarray(counts)[:, None]
    # Equal up to the last bits: each op alone is row-invariant on the CPU (the GDN mixer packed
    # and padded agree bit for bit under jit), but XLA fuses the whole forward differently for
    # the two layouts. Misplaced rows would differ at O(1); token forcing is the exactness test
    # (tests/test_serving_hybrid.py).
    close = dict(rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(hid_k)[live], np.asarray(hid_p)[live], **close)
    np.testing.assert_allclose(np.asarray(feat_k)[live], np.asarray(feat_p)[live], **close)
    for a, b in zip(cache_k.state + cache_k.conv, cache_p.state + cache_p.conv):
        np.testing.assert_allclose(np.asarray(a)[:2], np.asarray(b)[:2], **close)
    for a, b in zip(cache_k.k + cache_k.v, cache_p.k + cache_p.v):
        for r in range(2):
            lo, hi = int(pos[r]) - int(accepted[r]) - 1, int(pos[r]) + int(counts[r])
            np.testing.assert_allclose(np.asarray(a)[r, lo:hi], np.asarray(b)[r, lo:hi], **close)
    assert bool(jnp.all(jnp.isfinite(hid_k)))


def test_a_row_gone_nan_stays_in_its_row():
    """A slot whose GDN state went NaN sits first in the bucket; the other slot's live rows are
    unchanged: padding columns copy their own row's values, never another row's."""
    from specjax.decoding.sequences import GenerationConfig, prefill
    from specjax.models.hybrid import init_random_hybrid_params
    from specjax.models.target import chain_verify, with_replay_width
    from test_hybrid_decoding import hybrid_config
    cfg = hybrid_config(77)
    params = init_random_hybrid_params(cfg, jax.random.PRNGKey(77), scale=0.3)
    rng = np.random.default_rng(77)
    B, W = 2, 4
    prompts = jnp.asarray(rng.integers(3, cfg.vocab_size, (B, 7)), jnp.int32)
    cache, seqs, _, _ = prefill(params, cfg, GenerationConfig(max_new_tokens=8), prompts, jnp.array([7, 7]), 32,
                                jax.random.PRNGKey(0))
    cache = with_replay_width(params, cfg, cache, W)
    poisoned = cache.replaced(state=[s.at[0].set(jnp.nan) for s in cache.state])
    pos = seqs.length - 1
    tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, (B, W)), jnp.int32)
    span = pos[:, None] + jnp.arange(W)[None]
    counts = jnp.array([W, 2], jnp.int32)  # row 1 has padding columns
    run = jax.jit(lambda c: chain_verify(params, cfg, tokens, span, c, pos, (), (counts, B * W))[0])
    clean, dirty = run(cache), run(poisoned)
    assert not bool(jnp.all(jnp.isfinite(dirty[0])))
    np.testing.assert_array_equal(np.asarray(dirty[1, :2]), np.asarray(clean[1, :2]))
