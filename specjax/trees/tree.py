"""A token tree per row, as jit sees it: N nodes (a static count), node 0 the pending token (the root).

`parents[b, i]` is node i's parent in row b (< i), or -1: the root, and padding nodes a builder could
not fill (a row whose candidates ran out). Padding nodes are no node's child, so verification never
tests them; their slots get K/V like any node and lie past the committed length afterwards.
Siblings are ordered by index (builders add them best first): sampled verification tests them in
that order. Depths and the ancestor mask follow from the parents inside jit, so one compiled step
serves any shape a builder picks per row and per step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.trees.shape import TreeShape


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Tree:
    tokens: jax.Array  # [B, N] int32
    parents: jax.Array  # [B, N] int32
    max_depth: int = dataclasses.field(metadata=dict(static=True))  # no node is deeper

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    @staticmethod
    def from_shape(shape: TreeShape, tokens: jax.Array) -> "Tree":
        """A static shape, the same for every row."""
        parents = jnp.broadcast_to(jnp.asarray(shape.parents, jnp.int32), tokens.shape)
        return Tree(tokens.astype(jnp.int32), parents, shape.max_depth)

    def drafted(self) -> jax.Array:
        """[B, N] bool: a real node below the root (not the root, not padding)."""
        return self.parents >= 0

    def ancestors(self) -> jax.Array:
        """[B, N, N] bool: [b, i, j] iff node j is node i or one of its ancestors. One parent hop
        per level: max_depth gathers of [B, N] (depths are at most max_depth by contract)."""
        n = self.num_nodes
        eye = jnp.broadcast_to(jnp.eye(n, dtype=bool), (self.tokens.shape[0], n, n))

        def hop(_, carry):
            anc, up = carry  # up: the ancestor one level above the last one marked, or -1
            anc = anc | (jnp.arange(n)[None, None, :] == up[..., None])
            up = jnp.where(up >= 0, jnp.take_along_axis(self.parents, jnp.maximum(up, 0), axis=1), -1)
            return anc, up
        anc, _ = jax.lax.fori_loop(0, self.max_depth, hop, (eye, self.parents))
        return anc

    def first_nodes(self, n_nodes: jax.Array) -> "Tree":
        """The tree with every node past the first n_nodes[b] (in index order, the root not
        counted), or below such a node, turned into a padding node (parent -1: never on an
        accepted path). The kept nodes form a subtree: each keeps its whole path (budgets)."""
        anc = self.ancestors()
        within = jnp.arange(self.num_nodes)[None, :] <= n_nodes[:, None]  # [B, N]
        keep = jnp.all(within[:, None, :] | ~anc, axis=-1)
        return Tree(tokens=self.tokens, parents=jnp.where(keep, self.parents, -1), max_depth=self.max_depth)

    def depths(self, ancestors: jax.Array | None = None) -> jax.Array:
        """[B, N] int32 (padding nodes: 0)."""
        anc = self.ancestors() if ancestors is None else ancestors
        return jnp.sum(anc, axis=-1, dtype=jnp.int32) - 1

