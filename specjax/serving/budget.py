"""Mechanisms 1 and 2: which drafts a step verifies (a global budget by survival score), and how
the verified tokens are laid out (padded per slot, or packed into one flat bucket)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.serving.flat_forward import FlatBatch, flat_batch


def survival_scores(confidence: jax.Array) -> jax.Array:
    """confidence [B, k] (the drafter's peak probability at each position, or the slot's running
    acceptance rate; never the probability of the drawn draft, see step.py) -> [B, k] estimated probability that draft i is reached and accepted."""
    return jnp.cumprod(jnp.clip(confidence, 0.0, 1.0), axis=1)


def admitted_drafts(confidence: jax.Array, active: jax.Array, budget: int | None) -> jax.Array:
    """[B] drafts each slot verifies this step. Without a budget every active slot verifies all k;
    with one, the `budget` highest survival scores over the batch are admitted. Scores never
    rise along a draft and a stable sort breaks ties by position, so each slot's admitted drafts
    are a prefix."""
    B, k = confidence.shape
    if budget is None or budget >= B * k:
        return jnp.where(active, k, 0).astype(jnp.int32)
    scores = jnp.where(active[:, None], survival_scores(confidence), -1.0).reshape(-1)
    order = jnp.argsort(-scores, stable=True)
    chosen = jnp.zeros(B * k, bool).at[order[:budget]].set(True) & (scores >= 0)
    return chosen.reshape(B, k).sum(axis=1).astype(jnp.int32)


def layout(table: jax.Array, first_pos: jax.Array, col0: int, width: int, counts: jax.Array,
           packed: bool, bucket: int, depths: jax.Array | None = None,
           ancestors: jax.Array | None = None) -> FlatBatch:
    """Tokens table[b, col0 : col0 + counts[b]] at positions first_pos[b] + col0 + j as one flat
    batch. Padded: slot b owns flat tokens b * width .. (b + 1) * width - 1 (T = B * width).
    Packed: slots follow each other without gaps in a bucket of `bucket` tokens (the caller
    guarantees sum(counts) <= bucket). Trees: node col0 + j is written at first_pos[b] + col0 + j
    and rotated at first_pos[b] + depths[b, col0 + j]; `ancestors` [B, A, A] is the whole tree's
    (a second verify level, col0 > 0, attends to the first level's nodes already in the cache)."""
    B = table.shape[0]
    if packed:
        ends = jnp.cumsum(counts)
        f = jnp.arange(bucket)
        row = jnp.minimum(jnp.searchsorted(ends, f, side="right"), B - 1).astype(jnp.int32)
        col = f - (ends - counts)[row]
        valid = f < ends[-1]
    else:
        row = jnp.repeat(jnp.arange(B, dtype=jnp.int32), width)
        col = jnp.tile(jnp.arange(width, dtype=jnp.int32), B)
        valid = col < counts[row]
    col = jnp.clip(col, 0, width - 1)
    tokens = table[row, col0 + col]
    positions = first_pos[row] + col0 + col
    rope = None if depths is None else first_pos[row] + depths[row, col0 + col]
    return flat_batch(tokens, positions, row, col, valid, B, width, rope, ancestors, col0)


def choose_budget(verify_seconds, alpha, batch: int, k: int) -> int:
    """The step's draft budget from the cost of a verify pass at each token count: with per-draft
    conditional acceptance `alpha` [>= k] alike for every slot, the best budget gives each of the
    `batch` slots d drafts; d maximizes expected committed tokens per second of verify,
    batch (1 + sum_{i <= d} prod_{j <= i} alpha_j) / verify_seconds(batch (1 + d)).
    verify_seconds: a function of the flat token count (a profile or the cost model). >= 1."""
    import numpy as np
    survive = np.cumprod(np.clip(np.asarray(alpha[:k], np.float64), 0.0, 1.0))
    rates = [batch * (1.0 + survive[:d].sum()) / verify_seconds(batch * (1 + d)) for d in range(k + 1)]
    return max(1, batch * int(np.argmax(rates)))
