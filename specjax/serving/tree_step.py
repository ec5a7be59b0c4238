"""A serving verify step over trees of drafts: draft a tree per slot, admit the first nodes the
budget allows, verify them in one flat forward, or two with two-level verification (node j of
slot b at cache position first + j, rotated at first + depth), accept the longest agreeing path (greedy) or walk the tree
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


def _tree_level(params, cfg, st: ServingState, taps, tree: Tree, anc, depths, first, col0: int, width: int,
                counts, packed: bool, bucket: int, attention: str):
    """Verify nodes col0 .. col0 + counts[b] - 1 of each slot's tree -> (logits [B, width, V],
    features or None, cache)."""
    batch = layout(tree.tokens, first, col0, width, counts, packed, bucket, depths, anc)
    hidden, features, cache = flat_forward(params, cfg, batch, st.slots.pages, st.cache, taps, attention)
    logits = target_logits(params, cfg, hidden)[batch.unpack]
    return logits, None if features is None else features[batch.unpack], cache


def verify_tree_step(params, cfg: ModelConfig, drafter, gen: GenerationConfig, opts: ServingOptions,
                     forcing: bool, st: ServingState) -> ServingState:
    """Draft a tree per slot, verify its admitted nodes (one level, or two: nodes 1..k1 first, the
    rest only where the walk left them), accept, commit, move the path's K/V."""
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
    tree = tree.first_nodes(n_nodes)  # the admitted subtree
    anc = tree.ancestors()
    depths = tree.depths(anc)
    first = seqs.length - 1  # the pending token's position: the root
    taps = getattr(drafter, "taps", ())
    budget = opts.draft_budget(drafter.k, B)

    def walk(logits):
        if gen.sampling.greedy:
            return greedy_tree_accept(tree, logits)
        return sampled_tree_accept(tree, probabilities(logits, gen.sampling), key_v)

    k1 = N - 1 if opts.two_level_k1 is None else opts.two_level_k1
    counts = jnp.where(active, jnp.minimum(n_nodes, k1) + 1, 0)
    logits, feats, cache = _tree_level(params, cfg, st, taps, tree, anc, depths, first, 0, k1 + 1, counts,
                                       opts.packed, B + min(budget, B * k1), opts.attention)
    st = dataclasses.replace(st, cache=cache)
    if k1 < N - 1:
        # Level 2. The walk decides each node's test from its parent's logits, so a walk over
        # level 1's logits (the rest zero) is exact until it first steps onto a level-2 node: a
        # slot whose walk ends inside level 1 has its final result already, the others verify
        # every admitted level-2 node and walk again with the same key, which repeats the same
        # decisions up to that node. The verified tree never depends on an acceptance test, so
        # the output is the one-level step's, token for token and in distribution.
        zeros = jnp.zeros((B, N - 1 - k1) + logits.shape[2:], logits.dtype)
        _, path1, _ = walk(jnp.concatenate([logits, zeros], axis=1))
        promoted = active & (path1[:, -1] > k1)  # the path ends at a level-2 node
        counts2 = jnp.where(promoted, n_nodes - k1, 0)

        def level2(st):
            return _tree_level(params, cfg, st, taps, tree, anc, depths, first, k1 + 1, N - 1 - k1, counts2,
                               opts.packed, min(budget, B * (N - 1 - k1)), opts.attention)

        def skip(st):  # no walk left level 1: no second weight read
            shapes = jax.eval_shape(level2, st)
            return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes[:2]) + (st.cache,)

        logits2, feats2, cache = jax.lax.cond(jnp.any(promoted), level2, skip, st)
        st = dataclasses.replace(st, cache=cache)
        logits = jnp.concatenate([logits, logits2], axis=1)
        feats = None if feats is None else jnp.concatenate([feats, feats2], axis=1)
        counts = counts + counts2
    verified = active[:, None] & (jnp.arange(N)[None, :] < counts[:, None])
    failed = active & ~jnp.all(jnp.isfinite(logits) | ~verified[..., None], axis=(1, 2))
    num_accepted, path, out = walk(logits)
    if taps:  # the accepted path's features, at contiguous positions
        dstate = drafter.observe(dstate, jnp.take_along_axis(feats, path[..., None], axis=1), first)
    margins = jnp.take_along_axis(top2_margin(logits), path, axis=1)
    slots = commit_round(s, out, num_accepted, margins, failed, active, n_nodes,
                         jnp.maximum(jnp.minimum(n_nodes, spec.max_depth), 1), gen, forcing)
    cache = move_path(st.cache, s.pages, path, first, active & ~failed)
    return dataclasses.replace(st, slots=slots, cache=cache, dstate=dstate, key=key)
