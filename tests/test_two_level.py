"""Two-level verification for hybrid targets (decoding/two_level.py): a verify of a chain's
later tokens on level 1's cache, fed level 1's GDN inputs (`VerifiedNodes`) instead of running
level 1's rows again, gives the one-level verify's hidden states for those tokens, its K/V and
its whole-tree pending; padded and packed, after a deferred path, on random configs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest


@pytest.mark.parametrize("seed,packed", [(51, False), (52, True)])
def test_later_tokens_on_level_one_cache_equal_one_level(seed, packed):
    from specjax.decoding.sequences import GenerationConfig, prefill
    from specjax.models.hybrid import init_random_hybrid_params
    from specjax.models.target import chain_verify, target_commit, with_replay_width
    from test_hybrid_decoding import hybrid_config
    cfg = hybrid_config(seed)
    params = init_random_hybrid_params(cfg, jax.random.PRNGKey(seed), scale=0.3)
    rng = np.random.default_rng(seed)
    B, W, W1 = 2, 6, 3
    prompts = jnp.asarray(rng.integers(3, cfg.vocab_size, (B, 8)), jnp.int32)
    cache, seqs, _, _ = prefill(params, cfg, GenerationConfig(max_new_tokens=8), prompts, jnp.array([8, 5]), 48,
                                jax.random.PRNGKey(0))
    cache = with_replay_width(params, cfg, cache, W)
    pos = seqs.length - 1
    # one verify + commit first, so the step under test replays a deferred path
    tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, (B, W)), jnp.int32)
    span = pos[:, None] + jnp.arange(W)[None]
    _, _, cache, pending = chain_verify(params, cfg, tokens, span, cache, pos, ())
    accepted = jnp.array([3, 1])
    cache = target_commit(params, cfg, cache, pending, jnp.broadcast_to(jnp.arange(W), (B, W)), accepted, pos,
                          is_chain=True)
    pos = pos + accepted + 1
    tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, (B, W)), jnp.int32)
    span = pos[:, None] + jnp.arange(W)[None]
    pack = (lambda n, b: (jnp.full((B,), n, jnp.int32), b)) if packed else (lambda n, b: None)

    @jax.jit
    def one_level(cache):
        return chain_verify(params, cfg, tokens, span, cache, pos, (), pack(W, B * W))

    @jax.jit
    def two_levels(cache):
        _, _, cache1, pending1 = chain_verify(params, cfg, tokens[:, :W1], span[:, :W1], cache, pos, (),
                                              pack(W1, B * W1))
        return chain_verify(params, cfg, tokens[:, W1:], span[:, W1:], cache1, pos + W1, (), pack(W - W1, B * W),
                            pending1)

    hid1, _, cache1, pend1 = one_level(cache)
    hid2, _, cache2, pend2 = two_levels(cache)
    close = dict(rtol=1e-4, atol=1e-4)  # the last bits: XLA fuses the two programs differently
    np.testing.assert_allclose(np.asarray(hid2), np.asarray(hid1[:, W1:]), **close)
    np.testing.assert_array_equal(np.asarray(pend2.tokens), np.asarray(pend1.tokens))
    for a, b in zip(pend2.inputs, pend1.inputs):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **close)
    for a, b in zip(cache2.k + cache2.v + cache2.state + cache2.conv, cache1.k + cache1.v + cache1.state + cache1.conv):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **close)
    assert int(cache2.replay_len.max()) == 0
