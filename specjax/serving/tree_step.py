"""A serving verify step over trees of drafts: draft a tree per slot, admit the first nodes the
budget allows, verify them all in one flat forward (node j of slot b at cache position
first + j, rotated at first + depth), accept the longest agreeing path (greedy) or walk the tree
(sampled, exact in distribution), commit, and move the path's K/V to contiguous positions in the
slot's pages (docs/design/serving_trees.md). Pure; the chain step is `step.verify_step`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.decoding.sequences import GenerationConfig
from specjax.decoding.tree import draft_tree
from specjax.models.config import ModelConfig
from specjax.models.target import target_logits
from specjax.sampling import probabilities, top2_margin
from specjax.serving.budget import admitted_drafts, layout
from specjax.serving.flat_forward import flat_forward
from specjax.serving.paged_cache import PagedKVCache, token_pages
from specjax.serving.round import commit_round
from specjax.serving.state import ServingOptions, ServingState
from specjax.trees.tree import Tree
from specjax.trees.verify import greedy_tree_accept, sampled_tree_accept


def admitted_tree(tree: Tree, n_nodes: jax.Array) -> Tree:
    """The tree with every node past the first n_nodes[b] (in index order, the root not counted),
    or below such a node, turned into a padding node (parent -1: never on an accepted path). The
    admitted nodes form a subtree: each keeps its whole path."""
    anc = tree.ancestors()
    within = jnp.arange(tree.num_nodes)[None, :] <= n_nodes[:, None]  # [B, N]
    keep = jnp.all(within[:, None, :] | ~anc, axis=-1)
    return Tree(tokens=tree.tokens, parents=jnp.where(keep, tree.parents, -1), max_depth=tree.max_depth)


def move_path(cache: PagedKVCache, pages: jax.Array, path: jax.Array, first: jax.Array,
              active: jax.Array) -> PagedKVCache:
    """Move each active slot's path K/V from positions first + path[d] to first + d (d = 0..D),
    in its own pages; all reads happen before the writes."""
    B, W = path.shape
    row = jnp.repeat(jnp.arange(B, dtype=jnp.int32), W)
    valid = jnp.repeat(active, W)
    src = (first[:, None] + path).reshape(-1)
    dst = (first[:, None] + jnp.arange(W)[None, :]).reshape(-1)
    ps, os_ = token_pages(pages, row, jnp.maximum(src, 0), valid, cache.page_size)
    pd, od = token_pages(pages, row, jnp.maximum(dst, 0), valid, cache.page_size)

    def move(pool):
        return pool.at[pd, od].set(pool[ps, os_])
    return PagedKVCache(k=[move(x) for x in cache.k], v=[move(x) for x in cache.v])


def verify_tree_step(params, cfg: ModelConfig, drafter, gen: GenerationConfig, opts: ServingOptions,
                     forcing: bool, st: ServingState) -> ServingState:
    """Draft a tree per slot, verify its admitted nodes, accept, commit, move the path's K/V."""
    s = st.slots
    seqs = s.seqs
    B = seqs.length.shape[0]
    spec = opts.tree
    active = s.busy & ~seqs.done
    key, key_v = jax.random.split(st.key)
    tree, dstate = draft_tree(drafter, spec, gen.sampling, st.dstate, seqs)
    N = tree.num_nodes
    # Admission reads the slot's running acceptance rate, never the drafted tokens (see step.py).
    confidence = jnp.broadcast_to(s.accept_rate[:, None], (B, N - 1))
    n_nodes = admitted_drafts(confidence, active, opts.budget)  # [B] nodes past the root
    tree = admitted_tree(tree, n_nodes)
    anc = tree.ancestors()
    depths = tree.depths(anc)
    first = seqs.length - 1  # the pending token's position: the root
    counts = jnp.where(active, n_nodes + 1, 0)
    bucket = B + opts.draft_budget(drafter.k, B)
    batch = layout(tree.tokens, first, 0, N, counts, opts.packed, bucket, depths, anc)
    taps = getattr(drafter, "taps", ())
    hidden, features, cache = flat_forward(params, cfg, batch, s.pages, st.cache, taps, opts.attention)
    logits = target_logits(params, cfg, hidden)[batch.unpack]  # [B, N, V]
    verified = active[:, None] & (jnp.arange(N)[None, :] < counts[:, None])
    failed = active & ~jnp.all(jnp.isfinite(logits) | ~verified[..., None], axis=(1, 2))
    if gen.sampling.greedy:
        num_accepted, path, out = greedy_tree_accept(tree, logits)
    else:
        num_accepted, path, out = sampled_tree_accept(tree, probabilities(logits, gen.sampling), key_v)
    if taps:  # the accepted path's features, at contiguous positions
        dstate = drafter.observe(dstate, jnp.take_along_axis(features[batch.unpack], path[..., None], axis=1),
                                 first)
    margins = jnp.take_along_axis(top2_margin(logits), path, axis=1)
    slots = commit_round(s, out, num_accepted, margins, failed, active, n_nodes,
                         jnp.maximum(jnp.minimum(n_nodes, spec.max_depth), 1), gen, forcing)
    cache = move_path(cache, s.pages, path, first, active & ~failed)
    return dataclasses.replace(st, slots=slots, cache=cache, dstate=dstate, key=key)
