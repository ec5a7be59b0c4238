"""Tree speculative decoding: the drafter's per-position distributions become a token tree of a
static shape, the target verifies every node in one forward under the tree's visibility mask, and
the path it accepts is committed (its K/V moved to contiguous slots). Greedy: the longest path the
target agrees with; sampled: sequential candidate tests down the tree (exact in distribution).

Drafters: those that give per-position draft logits in one forward (`block_logits`: block drafters).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from specjax.decoding.chain import ChainStats, Forced, finish_round
from specjax.decoding.sequences import GenerationConfig, Sequences
from specjax.models.config import ModelConfig
from specjax.models.kv_cache import KVCache
from specjax.models.params import ModelParams
from specjax.models.transformer import forward_with_taps, lm_logits
from specjax.sampling import probabilities, top2_margin
from specjax.trees.shape import TreeShape
from specjax.trees.verify import commit_path, greedy_tree_accept, sampled_tree_accept, tree_mask, tree_tokens


def check_tree_drafter(drafter, shape: TreeShape, gen: GenerationConfig) -> None:
    if not hasattr(drafter, "block_logits"):
        raise NotImplementedError(f"tree verification needs per-position draft distributions (block "
                                  f"drafters); {type(drafter).__name__} has none")
    if shape.max_depth > drafter.k:
        raise ValueError(f"tree depth {shape.max_depth} exceeds the drafter's {drafter.k} positions")


def tree_step(target: ModelParams, cfg: ModelConfig, drafter, shape: TreeShape, gen: GenerationConfig,
              cache: KVCache, dstate, seqs: Sequences, stats: ChainStats, key, forced: Forced | None = None):
    pos = seqs.length - 1  # the pending token's slot: the tree's root
    draft_logits = drafter.block_logits(dstate, seqs)[:, :shape.max_depth]
    tokens = tree_tokens(shape, seqs.pending(), draft_logits)  # [B, N]
    positions = pos[:, None] + jnp.asarray(shape.depths)[None, :]
    mask = tree_mask(shape, pos, cache.num_slots)
    taps = getattr(drafter, "taps", ())
    hidden, features, cache = forward_with_taps(target, cfg, tokens, positions, cache, pos, taps, mask)
    logits = lm_logits(target, hidden)  # [B, N, V]
    if gen.sampling.greedy:
        num_accepted, path, out = greedy_tree_accept(shape, tokens, logits)
    else:
        num_accepted, path, out = sampled_tree_accept(shape, tokens, probabilities(logits, gen.sampling), key)
    cache = commit_path(cache, path, pos)
    if taps:  # the accepted path's features, at contiguous positions (the rest is never read)
        dstate = drafter.observe(dstate, jnp.take_along_axis(features, path[..., None], axis=1), pos)
    margins = jnp.take_along_axis(top2_margin(logits), path, axis=1)
    seqs, stats, forced = finish_round(gen, seqs, stats, forced, out, num_accepted, margins)
    return cache, dstate, seqs, stats, forced


@functools.partial(jax.jit, static_argnames=("cfg", "gen", "shape"))
def tree_decode(target, cfg, drafter, gen, shape, cache, dstate, seqs, key, forced=None):
    """Run tree steps until every row is done -> (sequences, stats, forced)."""
    stats = ChainStats.zeros(seqs.length.shape[0], shape.max_depth)

    def body(carry):
        cache, dstate, seqs, stats, forced, key = carry
        key, sub = jax.random.split(key)
        return (*tree_step(target, cfg, drafter, shape, gen, cache, dstate, seqs, stats, sub, forced), key)

    _, _, seqs, stats, forced, _ = jax.lax.while_loop(lambda c: ~jnp.all(c[2].done), body,
                                                      (cache, dstate, seqs, stats, forced, key))
    return seqs, stats, forced
