"""Two-level verification for steps that cannot reuse level 1's work: hybrid targets, whose
deferred GDN paths make every forward start from the committed state (docs/design/serving_hybrid.md).

Level 1 verifies the first w1 tokens (a chain's pending + k1 drafts, a tree's first k1 nodes, a
subtree); rows that level 1 cannot settle (`promoted`) take the full verify of w tokens, the others
keep level 1's results. The full verify is skipped when no row needs it. Each row's acceptance
then reads logits equal to the one-level step's where it reads them, so the output is the
one-level step's (see the callers for why each promotion rule is exact).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def verify_two_level(verify, cache, w1: int, w: int, promoted_of):
    """verify(width, cache, rows) -> (logits [B, width, V], features or None, cache, pending or
    None), rows [B] bool or None (all): the rows whose results will be used (a packed verify runs
    only those); promoted_of(level-1 logits padded to w with zeros) -> [B] bool. Returns the same
    four, width w."""
    def pad(x):
        return x if x is None else jnp.pad(x, ((0, 0), (0, w - w1)) + ((0, 0),) * (x.ndim - 2))

    logits1, feats1, cache1, pending1 = verify(w1, cache, None)
    level1 = (pad(logits1), pad(feats1), cache1, pad(pending1))
    promoted = promoted_of(level1[0])
    shapes = jax.eval_shape(lambda c: verify(w, c, promoted), cache)
    full = jax.lax.cond(jnp.any(promoted), lambda c: verify(w, c, promoted),
                        lambda c: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes), cache)

    def pick(a, b):  # every leaf is batch-leading (logits, features, K/V, GDN states, paths)
        return jnp.where(promoted.reshape((-1,) + (1,) * (a.ndim - 1)), a, b)
    return jax.tree.map(pick, full, level1)
