"""Two-level verification inside the decoder's steps, for hybrid targets in the serving engine
(docs/design/serving_hybrid.md).

Level 1 verifies the first w1 tokens (a chain's pending + k1 drafts, a tree's first k1 nodes, a
subtree). Rows that level 1 cannot settle (`promoted`) take a second forward over the later
nodes only, from level 1's cache: the attention layers read level 1's K/V, and the GDN layers
recompute level 1's nodes' part of the recurrence from their projected inputs (`VerifiedNodes`),
never running their layers again. The second forward is skipped when no row needs it. Each row's
acceptance then reads the logits the one-level step computes (to the last bits: the later nodes
are the same ops on the same inputs), so the output is the one-level step's (see the callers for
why each promotion rule is exact).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def verify_two_level(verify_first, verify_later, cache, w1: int, w: int, promoted_of):
    """verify_first(cache) -> (logits [B, w1, V], features or None, cache, pending);
    verify_later(cache after level 1, level 1's pending, rows [B] bool) -> the same for tokens
    w1 .. w - 1 (pending: the whole tree's); promoted_of(level-1 logits padded to w with zeros)
    -> [B] bool. Returns (logits [B, w, V], features, cache, pending) for width w."""
    def pad(x):
        return jnp.pad(x, ((0, 0), (0, w - w1)) + ((0, 0),) * (x.ndim - 2))

    logits1, feats1, cache1, pending1 = verify_first(cache)
    level1 = (pad(logits1), None if feats1 is None else pad(feats1), cache1, jax.tree.map(pad, pending1))
    promoted = promoted_of(level1[0])

    def level2(c):
        logits2, feats2, cache2, pending = verify_later(c, pending1, promoted)
        join = lambda a, b: jnp.concatenate([a, b], axis=1)
        return join(logits1, logits2), None if feats1 is None else join(feats1, feats2), cache2, pending

    shapes = jax.eval_shape(level2, cache1)

    def skip(c):  # no row promoted: no second weight read; the cache stays level 1's
        zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)
        return zeros[0], zeros[1], c, zeros[3]
    full = jax.lax.cond(jnp.any(promoted), level2, skip, cache1)

    def pick(a, b):  # every leaf is batch-leading (logits, features, K/V, GDN states, paths)
        return jnp.where(promoted.reshape((-1,) + (1,) * (a.ndim - 1)), a, b)
    if getattr(cache1, "pages", None) is None:
        return jax.tree.map(pick, full, level1)
    # A paged cache's pools are shared by all rows (not batch-leading): keep level 2's. Level 2
    # wrote only positions past level 1's nodes, and a row not promoted commits a path inside
    # level 1's nodes, so it never reads those positions before a later step rewrites them.
    pools = full[2].k, full[2].v
    strip = lambda out: (out[0], out[1], out[2].replaced(k=[], v=[]), out[3])
    logits, feats, cache, pending = jax.tree.map(pick, strip(full), strip(level1))
    return logits, feats, cache.replaced(k=pools[0], v=pools[1]), pending
