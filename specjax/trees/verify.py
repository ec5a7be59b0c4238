"""Tree verification on the device, for per-row trees (`Tree`): the target's visibility mask over the
tree, the path it accepts (greedy: the longest agreeing path; sampled: sequential candidate tests,
exact in distribution), and the commit of that path.

Layout: node i of the tree sits at cache slot start + i during the verify forward (start = the
pending token's slot), at RoPE position start + depth[i], seeing the committed prefix and its own
ancestors. After acceptance the path's K/V are moved to slots start .. start + depth, where the
next step expects them; every other node's slot lies past the new length (masked, then overwritten).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.sampling import sample_from
from specjax.trees.tree import Tree


def tree_mask(tree: Tree, start: jax.Array, num_slots: int, ancestors: jax.Array | None = None) -> jax.Array:
    """[B, N, S] bool: node i sees slots < start and the slots of its ancestors (itself included)."""
    anc = tree.ancestors() if ancestors is None else ancestors  # [B, N, N]
    n = tree.num_nodes
    rel = jnp.arange(num_slots)[None, None, :] - start[:, None, None]  # [B, 1, S]
    in_tree = (rel >= 0) & (rel < n)
    visible_node = jnp.take_along_axis(
        anc, jnp.broadcast_to(jnp.clip(rel, 0, n - 1), (anc.shape[0], n, num_slots)), axis=2)
    return (rel < 0) | (in_tree & visible_node)


def _at_parent(values: jax.Array, tree: Tree) -> jax.Array:
    """values [B, N] -> [B, N]: each node's parent's value (the root's own for parentless nodes)."""
    return jnp.take_along_axis(values, jnp.maximum(tree.parents, 0), axis=1)


def _on_accepted_path(passed: jax.Array, ancestors: jax.Array) -> jax.Array:
    """[B, N]: the node and every ancestor below the root passed its test (the root always does)."""
    passed = passed.at[:, 0].set(True)
    return jnp.all(passed[:, None, :] | ~ancestors, axis=-1)


def _path_and_out(tree: Tree, ancestors, depths, end, bonus):
    """The accepted path ending at node `end` [B] -> (num_accepted [B], path [B, D + 1] node indices
    root first (past num_accepted: `end` repeated, unused), out [B, D + 1]: the accepted drafts, then
    `bonus` (the target's own next token) at index num_accepted)."""
    rows = jnp.arange(end.shape[0])
    num_accepted = depths[rows, end]
    levels = jnp.arange(tree.max_depth + 1)
    at_level = ancestors[rows, end][:, None, :] & (depths[:, None, :] == levels[None, :, None])  # [B, D+1, N]
    path = jnp.where(jnp.any(at_level, -1), jnp.argmax(at_level, -1), end[:, None]).astype(jnp.int32)
    path_tokens = jnp.take_along_axis(tree.tokens, path, axis=1)
    out = jnp.concatenate([path_tokens[:, 1:], jnp.zeros_like(bonus[:, None])], axis=1)
    return num_accepted.astype(jnp.int32), path, out.at[rows, num_accepted].set(bonus)


def greedy_tree_accept(tree: Tree, target_logits: jax.Array):
    """target_logits [B, N, V] -> (num_accepted [B], path [B, D + 1], out [B, D + 1]). A node is
    accepted when it and every ancestor equal the target's choice after their parent; the deepest
    accepted node (lowest index on a tie) ends the path, and the target's choice after it follows.
    Whatever the tree holds, `out` is the target's own argmax chain: token-exact against AR."""
    choice = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, N]
    anc = tree.ancestors()
    depths = tree.depths(anc)
    correct = tree.drafted() & (tree.tokens == _at_parent(choice, tree))
    accepted = _on_accepted_path(correct, anc)
    end = jnp.argmax(jnp.where(accepted, depths, -1), axis=-1)
    bonus = jnp.take_along_axis(choice, end[:, None], axis=1)[:, 0]
    return _path_and_out(tree, anc, depths, end, bonus)


def sampled_tree_accept(tree: Tree, target_probs: jax.Array, key: jax.Array):
    """Sampling that keeps the target distribution exactly, with several candidates per node.

    The rule, as a walk: at node u (target distribution p after u's path), test u's children in
    index order, each a fixed candidate: accept child c with probability r(t_c) / sum(r), where r
    starts as p and loses each rejected candidate's token. Token t_j then comes out with probability
    p(t_j) (the rejections before it telescope), and if every child is rejected the next token is
    drawn from r normalized: every other token also with probability p. An accepted child becomes u;
    a full rejection (or a leaf) ends the walk with that draw as the target's own token.

    Exact for any candidates that do not depend on this step's target outputs (the drafter's, built
    from the committed tokens). Siblings should hold distinct tokens (every builder's do); a repeated
    sibling is handled anyway: its token was already removed from r, so it is never accepted.

    Vectorized: every node gets its own uniform and its test is evaluated as if its parent were
    reached: the mass left before it is p's total minus the distinct tokens of its earlier siblings
    (exactly r's sum when they were all rejected). A node is on the walk when it and each ancestor
    is the first passing child of its parent; those nodes form one path, whose end draws the bonus.
    Same outputs as `greedy_tree_accept`."""
    k_test, k_draw = jax.random.split(key)
    B, N = tree.tokens.shape
    rows = jnp.arange(B)[:, None]
    drafted = tree.drafted()
    anc = tree.ancestors()
    depths = tree.depths(anc)
    parent = jnp.maximum(tree.parents, 0)
    p_token = target_probs[rows, parent, tree.tokens]  # [B, N]: p after the parent, at the node's token
    p_total = _at_parent(jnp.sum(target_probs, axis=-1), tree)
    idx = jnp.arange(N)
    earlier_sibling = (drafted[:, None, :] & (tree.parents[:, None, :] == tree.parents[:, :, None])
                       & (idx[None, None, :] < idx[None, :, None]))  # [B, j, l]: l is before j under j's parent
    repeated = jnp.any(earlier_sibling & (tree.tokens[:, None, :] == tree.tokens[:, :, None]), axis=-1)
    mass = jnp.where(drafted & ~repeated, p_token, 0.0)
    removed = jnp.sum(jnp.where(earlier_sibling, mass[:, None, :], 0.0), axis=-1)
    u = jax.random.uniform(k_test, (B, N))
    passes = drafted & (u * (p_total - removed) < mass)
    first = passes & ~jnp.any(earlier_sibling & passes[:, None, :], axis=-1)
    walked = _on_accepted_path(first, anc)
    end = jnp.argmax(jnp.where(walked, depths, -1), axis=-1)
    # the end's children were all rejected (or it has none): draw from p without their tokens
    p_end = target_probs[rows[:, 0], end]  # [B, V]
    is_child = drafted & (tree.parents == end[:, None])
    residual = p_end.at[rows, tree.tokens].multiply(jnp.where(is_child, 0.0, 1.0))
    total = jnp.sum(residual, axis=-1, keepdims=True)
    # total 0 only if p sat entirely on rejected candidates (probability 0): keep p to stay finite
    residual = jnp.where(total > 0, residual / jnp.where(total > 0, total, 1.0), p_end)
    return _path_and_out(tree, anc, depths, end, sample_from(residual, k_draw))
