"""Packing the live tokens of a padded [B, C] layout into one flat bucket, and back.

The serving engine's packed verification for hybrid targets (docs/design/serving_hybrid.md)
runs every row-wise op (embedding, norms, GEMMs, MLP) on the flat bucket and only the ops that
mix tokens of one row (attention, the GDN recurrence) on the padded layout, as the dense
`serving/flat_forward.py` does. Row-wise ops see the same rows either way, so the numerics are
the padded forward's.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RowPacking:
    row: jax.Array  # [N] each flat token's row (tokens past the live ones: row 0)
    col: jax.Array  # [N] its column
    unpack: jax.Array  # [B, C] flat index of (row, column); where not live, the row's first live token's

    def to_flat(self, x: jax.Array) -> jax.Array:
        """x [B, C, ...] -> [1, N, ...] (the bucket's spare tokens copy row 0's column 0)."""
        return x[self.row, self.col][None]

    def to_rows(self, x: jax.Array) -> jax.Array:
        """x [1, N, ...] -> [B, C, ...]; columns that are not live copy their own row's first live
        token (rows without one: flat token 0; nothing of theirs is kept). Padding must hold real
        values of its own row: a zero vector normalizes to NaN in the GDN layers, another row's
        token may be NaN (a failing request), and NaN times a zero mask weight is still NaN."""
        return x[0][self.unpack]


def pack_rows(live: jax.Array, bucket: int) -> RowPacking:
    """live [B, C] bool -> the packing of its live entries, row by row, into `bucket` tokens.
    The caller guarantees sum(live) <= bucket (a static bound); entries past it would be lost."""
    B, C = live.shape
    flat = live.reshape(-1)
    index = jnp.cumsum(flat, dtype=jnp.int32) - 1  # [B * C]
    where = jnp.where(flat, index, bucket)  # out of range: dropped
    cells = jnp.arange(B * C, dtype=jnp.int32)
    row = jnp.zeros(bucket, jnp.int32).at[where].set(cells // C, mode="drop")
    col = jnp.zeros(bucket, jnp.int32).at[where].set(cells % C, mode="drop")
    index = index.reshape(B, C)
    first = jnp.min(jnp.where(live, index, jnp.iinfo(jnp.int32).max), axis=1)  # [B]
    first = jnp.where(jnp.any(live, axis=1), first, 0)
    unpack = jnp.where(live, index, first[:, None])
    return RowPacking(row=row, col=col, unpack=unpack)
