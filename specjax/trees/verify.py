"""Tree verification on the device (greedy, and sampled by sequential candidate tests): tree tokens from per-position draft logits, the target's
visibility mask over the tree, the longest path the target agrees with, and its commit.

Layout: node i of the tree sits at cache slot start + i during the verify forward (start = the
pending token's slot), at RoPE position start + depth[i], seeing the committed prefix and its own
ancestors. After acceptance the path's K/V are moved to slots start .. start + depth, where the
next step expects them; every other node's slot lies past the new length (masked, then overwritten).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.models.kv_cache import KVCache
from specjax.sampling import sample_from
from specjax.trees.shape import TreeShape


def tree_tokens(shape: TreeShape, pending: jax.Array, logits: jax.Array) -> jax.Array:
    """pending [B], logits [B, D, V] (position d's draft distribution, d = 1..D, as block drafters
    give: independent of the path) -> tokens [B, N]: node i holds the ranks[i]-th likeliest token
    of position depths[i]."""
    top = jax.lax.top_k(logits, int(shape.ranks.max()) + 1)[1].astype(jnp.int32)  # [B, D, R]
    d, r = shape.depths[1:] - 1, shape.ranks[1:]
    return jnp.concatenate([pending[:, None], top[:, d, r]], axis=1)


def tree_mask(shape: TreeShape, start: jax.Array, num_slots: int) -> jax.Array:
    """[B, N, S] bool: node i sees slots < start and the slots of its ancestors (itself included)."""
    slots = jnp.arange(num_slots)[None, None, :]
    rel = slots - start[:, None, None]  # [B, 1, S]
    anc = jnp.asarray(shape.ancestors)  # [N, N]
    in_tree = (rel >= 0) & (rel < shape.num_nodes)
    visible_node = jnp.take_along_axis(
        jnp.broadcast_to(anc[None], (start.shape[0],) + anc.shape),
        jnp.broadcast_to(jnp.clip(rel, 0, shape.num_nodes - 1), (start.shape[0], shape.num_nodes, num_slots)),
        axis=2)
    return (rel < 0) | (in_tree & visible_node)


def greedy_tree_accept(shape: TreeShape, tokens: jax.Array, target_logits: jax.Array):
    """tokens [B, N], target_logits [B, N, V] -> (num_accepted [B], path [B, D + 1] node indices
    root first, out [B, D + 1]: the accepted drafts then the target's own next token). A node is
    accepted when it and every ancestor equal the target's choice after its parent; the deepest
    accepted node (lowest index on a tie) ends the path."""
    choice = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, N]
    parents = jnp.asarray(shape.parents[1:], jnp.int32)
    correct = jnp.concatenate([jnp.ones_like(tokens[:, :1], bool), tokens[:, 1:] == choice[:, parents]], 1)
    anc = jnp.asarray(shape.ancestors)
    accepted = jnp.all(correct[:, None, :] | ~anc[None], axis=-1)  # [B, N]
    depths = jnp.asarray(shape.depths)
    best = jnp.argmax(jnp.where(accepted, depths, -1), axis=-1)  # first index of the max depth
    num_accepted = depths[best]
    # path[d] = the ancestor of `best` at depth d (past num_accepted: repeats `best`, unused)
    on_path = anc[best]  # [B, N]
    levels = jnp.arange(shape.max_depth + 1)
    at_level = on_path[:, None, :] & (depths[None, None, :] == levels[None, :, None])  # [B, D+1, N]
    path = jnp.where(jnp.any(at_level, -1), jnp.argmax(at_level, -1), best[:, None]).astype(jnp.int32)
    path_tokens = jnp.take_along_axis(tokens, path, axis=1)
    bonus = jnp.take_along_axis(choice, best[:, None], axis=1)[:, 0]
    out = jnp.concatenate([path_tokens[:, 1:], jnp.zeros_like(bonus[:, None])], axis=1)
    out = out.at[jnp.arange(out.shape[0]), num_accepted].set(bonus)
    return num_accepted.astype(jnp.int32), path, out


def sampled_tree_accept(shape: TreeShape, tokens: jax.Array, target_probs: jax.Array, key: jax.Array):
    """Sampling that keeps the target distribution exactly, with several candidates per node.

    Walk down from the root. At node u (target distribution p after u's path), test u's children
    in rank order, each a fixed candidate: accept child c with probability r(t_c) / sum(r), where
    r starts as p and loses each rejected candidate's token. So token t_j comes out with
    probability p(t_j) (the product telescopes), and if every child is rejected the next token is
    drawn from r normalized: every other token also with probability p. An accepted child becomes
    u; a rejection or a leaf ends the walk with that draw as the target's own token. Children must
    hold distinct tokens (the top-k ranks do). Same outputs as `greedy_tree_accept`."""
    B = tokens.shape[0]
    rows = jnp.arange(B)
    kids_of = jnp.asarray(shape.children)  # [N, C]
    cur = jnp.zeros(B, jnp.int32)
    stopped = jnp.zeros(B, bool)
    bonus = jnp.zeros(B, jnp.int32)
    path = [cur]
    keys = jax.random.split(key, shape.max_depth + 1)
    for level in range(shape.max_depth):
        k_test, k_draw = jax.random.split(keys[level])
        u = jax.random.uniform(k_test, (B, kids_of.shape[1]))
        residual = target_probs[rows, cur]  # [B, V]
        chosen = jnp.full(B, -1, jnp.int32)
        for j in range(kids_of.shape[1]):
            c = kids_of[cur, j]
            live = (c >= 0) & (chosen < 0) & ~stopped
            t = tokens[rows, jnp.maximum(c, 0)]
            r_t = residual[rows, t]
            take = live & (u[:, j] * jnp.sum(residual, axis=-1) < r_t)
            chosen = jnp.where(take, c, chosen)
            residual = jnp.where((live & ~take)[:, None], residual.at[rows, t].set(0.0), residual)
        stop = ~stopped & (chosen < 0)
        mass = jnp.sum(residual, axis=-1, keepdims=True)
        # mass 0 only if p sat entirely on rejected candidates (probability 0): keep p to stay finite
        residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), target_probs[rows, cur])
        bonus = jnp.where(stop, sample_from(residual, k_draw), bonus)
        stopped = stopped | stop
        cur = jnp.where(stopped, cur, chosen)
        path.append(cur)
    at_leaf = ~stopped  # walked the whole depth: the leaf's own distribution gives the next token
    bonus = jnp.where(at_leaf, sample_from(target_probs[rows, cur], keys[-1]), bonus)
    path = jnp.stack(path, axis=1)  # [B, D + 1]
    num_accepted = jnp.asarray(shape.depths)[cur].astype(jnp.int32)
    path_tokens = jnp.take_along_axis(tokens, path, axis=1)
    out = jnp.concatenate([path_tokens[:, 1:], jnp.zeros_like(bonus[:, None])], axis=1)
    return num_accepted, path, out.at[rows, num_accepted].set(bonus)


def commit_path(cache: KVCache, path: jax.Array, start: jax.Array) -> KVCache:
    """Move the accepted path's K/V from slots start + path[d] to start + d (d = 0..D)."""
    src = start[:, None] + path  # [B, D+1]
    dst = start[:, None] + jnp.arange(path.shape[1])[None, :]
    rows = jnp.arange(path.shape[0])[:, None]

    def move(buf):
        return buf.at[rows, dst].set(buf[rows, src])
    return KVCache(k=[move(k) for k in cache.k], v=[move(v) for v in cache.v])
