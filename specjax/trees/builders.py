"""Tree builders: from a drafter's per-position draft distributions to a per-row `Tree`, in jit.

Every builder takes `pending` [B] (the root's token) and `logits` [B, D, V]: position d's draft
distribution (d = 1..D). Block drafters give it in one forward, the same for every path; AR drafters
(model, n-gram) give it along their own drafted chain (`propose_logits`), so below a node off the
chain it is a guess conditioned on the chain instead: still lossless, verification decides. With an
AR drafter the chain is passed as `chain` [B, D] and ranked first at every depth.

- `static_tree`: a fixed `TreeShape` (for_budget, a chain, a YAML shape): node i holds the
  ranks[i]-th likeliest token of position depths[i]. One shape for every row and step.
- `best_first_tree` (DDTree): the `num_nodes` nodes of highest path probability (the product of
  the draft probabilities of the path's tokens), per row and per step.
- `topk_tree` (AR drafters): the drafter's chain, then the likeliest alternatives hanging off chain
  nodes (each a leaf: the drafter has no distribution below them), best first by path probability.

Siblings always hold distinct tokens (ranks of one distribution), ordered likeliest first, and no
builder reads the target: both conditions of exact sampled verification (trees/verify.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.errors import ConfigError
from specjax.trees.shape import TreeShape
from specjax.trees.tree import Tree

BUILDERS = ("static", "best_first", "topk")
LOGP_FLOOR = -1e6  # log 0 (a top-p cut) stays finite: sums of <= 64 of them never overflow
CHAIN_FIRST = 1e9  # added to a chain candidate's score in `topk_tree`: the chain is always taken first


@dataclasses.dataclass(frozen=True)
class TreeSpec:
    """How a step builds its tree (hashable: a static argument of the decode loop).
    nodes: drafted nodes, the root excluded; max_depth: no node deeper (<= the drafter's k)."""
    builder: str
    nodes: int
    max_depth: int
    shape: TreeShape | None = None  # the static builder's shape

    def __post_init__(self):
        if self.builder not in BUILDERS:
            raise ConfigError(f"tree builder must be one of {', '.join(BUILDERS)}, got {self.builder!r}")
        if self.builder == "static":  # any shape, even the root alone (plain AR through a tree step)
            if self.shape is None:
                raise ConfigError("the static tree builder needs a shape")
        elif self.nodes < 1 or self.max_depth < 1:
            raise ConfigError(f"a tree needs >= 1 node and depth >= 1, got {self.nodes} nodes, "
                              f"depth {self.max_depth}")

    @property
    def num_nodes(self) -> int:
        """Nodes in the verified tree, the root included."""
        return self.nodes + 1

    @staticmethod
    def of_shape(shape: TreeShape) -> "TreeSpec":
        return TreeSpec("static", shape.num_nodes - 1, shape.max_depth, shape)

    @staticmethod
    def budget(builder: str, nodes: int, depth: int) -> "TreeSpec":
        """`nodes` drafted nodes at most `depth` deep (static: `TreeShape.for_budget`)."""
        if builder == "static":
            return TreeSpec.of_shape(TreeShape.for_budget(nodes, depth))
        return TreeSpec(builder, nodes, min(depth, nodes))


def as_tree_spec(tree) -> TreeSpec:
    """A `TreeSpec`, or a `TreeShape` (the static builder)."""
    return TreeSpec.of_shape(tree) if isinstance(tree, TreeShape) else tree


def log_probs(logits: jax.Array) -> jax.Array:
    return jnp.maximum(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), LOGP_FLOOR)


def ranked(logits: jax.Array, count: int, chain: jax.Array | None = None):
    """logits [B, D, V] -> (tokens [B, D, R], log-probabilities [B, D, R]) of each position's R =
    min(count, V) likeliest tokens, best first; with `chain` [B, D], the chain's token first."""
    logp = log_probs(logits)
    count = min(count, logp.shape[-1])
    if chain is None:
        top_logp, top = jax.lax.top_k(logp, count)
        return top.astype(jnp.int32), top_logp
    chain = chain.astype(jnp.int32)
    chain_logp = jnp.take_along_axis(logp, chain[..., None], axis=-1)
    others = jnp.where(jax.nn.one_hot(chain, logp.shape[-1], dtype=bool), -jnp.inf, logp)
    top_logp, top = jax.lax.top_k(others, count - 1)
    return (jnp.concatenate([chain[..., None], top.astype(jnp.int32)], axis=-1),
            jnp.concatenate([chain_logp, top_logp], axis=-1))


def static_tree(shape: TreeShape, pending: jax.Array, logits: jax.Array, chain: jax.Array | None = None) -> Tree:
    """Node i holds the ranks[i]-th token of position depths[i]: the rank-0 spine is the top-1 chain
    (or the drafter's own chain)."""
    need = int(shape.ranks.max()) + 1
    if need > logits.shape[-1]:
        raise ConfigError(f"tree shape has {need} siblings under one node; the vocabulary has "
                          f"only {logits.shape[-1]} distinct tokens")
    if shape.max_depth > logits.shape[1]:
        raise ConfigError(f"tree depth {shape.max_depth} exceeds the {logits.shape[1]} drafted positions")
    if shape.num_nodes == 1:
        return Tree.from_shape(shape, pending[:, None])
    top, _ = ranked(logits, need, chain)
    d, r = shape.depths[1:] - 1, shape.ranks[1:]
    return Tree.from_shape(shape, jnp.concatenate([pending[:, None], top[:, d, r]], axis=1))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _Frontier:
    """Candidate nodes not yet in the tree, one slot each ([B, F]). A candidate is the rank-th
    likeliest token of position `depth` under tree node `parent` (whose path score is `base`)."""
    valid: jax.Array
    base: jax.Array
    parent: jax.Array
    depth: jax.Array
    rank: jax.Array
    chain: jax.Array  # the candidate continues the drafter's chain


def _best_first(pending, logits, num_nodes: int, max_depth: int, chain=None, chain_only: bool = False) -> Tree:
    """Fixed-iteration best-first search. Every node is no likelier than its parent (log-probabilities
    are <= 0) nor than its previous sibling (ranks are sorted), so popping the best frontier node
    and pushing its first child and its next sibling yields nodes in order of path probability: after
    num_nodes pops, the tree is a top-num_nodes set (ties broken by the frontier's order; with a
    `chain` that is not each position's top-1, its rank-0 slot may break the order: still a valid
    tree). chain_only: only chain nodes get children, and chain candidates go first (`topk_tree`)."""
    if max_depth > logits.shape[1]:
        raise ConfigError(f"tree depth {max_depth} exceeds the {logits.shape[1]} drafted positions")
    B = pending.shape[0]
    tok, logp = ranked(logits[:, :max_depth], num_nodes, chain)  # [B, D, R]
    R = tok.shape[-1]
    F = num_nodes + 1  # each pop frees a slot and fills at most two: the frontier grows by <= 1
    rows = jnp.arange(B)
    zeros = jnp.zeros((B, F), jnp.int32)
    frontier = _Frontier(valid=jnp.zeros((B, F), bool).at[:, 0].set(True), base=jnp.zeros((B, F)),
                         parent=zeros, depth=zeros.at[:, 0].set(1), rank=zeros,
                         chain=jnp.zeros((B, F), bool).at[:, 0].set(True))
    tokens = jnp.broadcast_to(pending[:, None], (B, num_nodes + 1)).astype(jnp.int32)
    parents = jnp.full((B, num_nodes + 1), -1, jnp.int32)

    def pop(s, carry):
        f, tokens, parents = carry
        node = s + 1
        # invalid slots may hold an out-of-range depth or rank: clip before reading, masked below
        score_of = f.base + logp[rows[:, None], jnp.clip(f.depth - 1, 0, max_depth - 1), jnp.minimum(f.rank, R - 1)]
        priority = score_of + (jnp.where(f.chain, CHAIN_FIRST, 0.0) if chain_only else 0.0)
        j = jnp.argmax(jnp.where(f.valid, priority, -jnp.inf), axis=1)
        ok = f.valid[rows, j]  # False once the candidates ran out: the node stays padding
        depth, rank, on_chain = f.depth[rows, j], f.rank[rows, j], f.chain[rows, j]
        score, base, parent = score_of[rows, j], f.base[rows, j], f.parent[rows, j]
        token = tok[rows, jnp.clip(depth - 1, 0, max_depth - 1), jnp.minimum(rank, R - 1)]
        tokens = tokens.at[:, node].set(jnp.where(ok, token, tokens[:, node]))
        parents = parents.at[:, node].set(jnp.where(ok, parent, -1))
        has_child = ok & (depth < max_depth) & (on_chain if chain_only else True)
        has_sibling = ok & (rank + 1 < R)
        # the first child takes the popped slot, the next sibling the fresh slot `node`
        f = _Frontier(
            valid=f.valid.at[rows, j].set(has_child).at[:, node].set(has_sibling),
            base=f.base.at[rows, j].set(score).at[:, node].set(base),
            parent=f.parent.at[rows, j].set(node).at[:, node].set(parent),
            depth=f.depth.at[rows, j].set(depth + 1).at[:, node].set(depth),
            rank=f.rank.at[rows, j].set(0).at[:, node].set(rank + 1),
            chain=f.chain.at[rows, j].set(on_chain).at[:, node].set(False))
        return f, tokens, parents

    _, tokens, parents = jax.lax.fori_loop(0, num_nodes, pop, (frontier, tokens, parents))
    return Tree(tokens, parents, max_depth)


def best_first_tree(pending: jax.Array, logits: jax.Array, num_nodes: int, max_depth: int,
                    chain: jax.Array | None = None) -> Tree:
    """The `num_nodes` drafted nodes of highest path probability at most `max_depth` deep (DDTree),
    per row: node scores are sums of log-probabilities of `logits` along the path. Rows whose
    candidates run out (a tiny vocabulary) keep padding nodes."""
    return _best_first(pending, logits, num_nodes, max_depth, chain)


def topk_tree(pending: jax.Array, logits: jax.Array, num_nodes: int, max_depth: int,
              chain: jax.Array | None = None) -> Tree:
    """The drafter's chain (`chain`, else the top-1 chain) min(num_nodes, max_depth) deep, then the
    remaining budget as alternatives to chain tokens: each depth's next likeliest tokens, siblings of
    the chain node there, taken in order of path probability (chain prefix times the alternative)."""
    return _best_first(pending, logits, num_nodes, max_depth, chain, chain_only=True)


def build_tree(spec: TreeSpec, pending: jax.Array, logits: jax.Array, chain: jax.Array | None = None) -> Tree:
    if spec.builder == "static":
        return static_tree(spec.shape, pending, logits, chain)
    build = best_first_tree if spec.builder == "best_first" else topk_tree
    return build(pending, logits, spec.nodes, spec.max_depth, chain)
